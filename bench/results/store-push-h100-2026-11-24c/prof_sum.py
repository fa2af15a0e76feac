import sys, re, collections
for path in sys.argv[1:]:
    print("==", path)
    by_thread = collections.Counter(); leaf = collections.defaultdict(collections.Counter)
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        n = int(n); frames = stack.split(";")
        t = re.sub(r"\(\d+\)", "", frames[0]).strip(); t = re.sub(r"_\d+$", "", t)
        by_thread[t] += n
        # leaf = last two gpusnap/stdlib frames, without line numbers
        f = [re.sub(r" \(.*?:\d+\)", "", x) for x in frames[1:]]
        key = " < ".join(reversed(f[-3:]))
        leaf[t][key] += n
    for t, tot in by_thread.most_common(8):
        print(f"  {t}: {tot} samples")
        for k, n in leaf[t].most_common(6):
            print(f"      {n:6d} {100*n/tot:5.1f}%  {k[:170]}")
