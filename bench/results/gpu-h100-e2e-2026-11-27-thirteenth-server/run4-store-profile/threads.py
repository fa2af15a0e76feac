"""Where each kind of thread of the store after the dump spends its time, from py-spy's
chrometrace (bench/e2e.py --py-spy): python3 threads.py checkpoint-store-after-dump-server.chrometrace.json.gz"""
import collections
import gzip
import json
import sys

ev = json.load(gzip.open(sys.argv[1]))
ev.sort(key=lambda e: e["ts"])
stacks, last, spans = collections.defaultdict(list), {}, collections.defaultdict(list)
for e in ev:
    tid = e["tid"]
    if e["ph"] == "B":
        if stacks[tid]:
            spans[tid].append((last[tid], e["ts"], tuple(stacks[tid])))
        stacks[tid].append(f"{e['name']} ({e['args'].get('filename', '').split('/')[-1]}:{e['args'].get('line')})")
    elif stacks[tid]:
        spans[tid].append((last[tid], e["ts"], tuple(stacks[tid])))
        stacks[tid].pop()
    last[tid] = e["ts"]
main = max(spans, key=lambda t: sum(1 for s in spans[t] if any("store_checkpoint (" in f for f in s[2])))
window = [s for s in spans[main] if any("store_checkpoint (" in f for f in s[2])]
t0, t1 = min(s[0] for s in window), max(s[1] for s in window)


def kind(tid: int) -> str:
    if tid == main:
        return "main"
    frames = " ".join(f for s in spans[tid] for f in s[2][:8])
    for k, mark in (("worker", "_read_and_hash"), ("lane", "PackWriter._write"), ("sealer", "_commit_pack")):
        if mark in frames:
            return k
    return "other"


agg: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
for tid in spans:
    for a, b, stack in spans[tid]:
        if b < t0 or a > t1:
            continue
        inner = [f for f in stack if any(x in f for x in ("pack.py", "store.py", "artifact.py", "pagemap.py", "thread.py", "threading.py", "_base.py"))]
        agg[kind(tid)][inner[-1] if inner else stack[-1]] += min(b, t1) - max(a, t0)
print(f"store window {(t1 - t0) / 1000:.0f} ms")
for k, c in agg.items():
    n = len([t for t in spans if kind(t) == k])
    print(f"== {k}: {n} threads, {sum(c.values()) / 1000:.0f} thread-ms")
    for f, v in c.most_common(8):
        print(f"   {v / 1000:8.0f} {f[:100]}")
