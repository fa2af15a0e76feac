"""Inference server workload for bench/e2e.py: GPT-2 large (fp32) from a safetensors file.

    python3 gpt2_server.py setup DIR            write random-seeded weights (no download) to DIR
    python3 gpt2_server.py serve DIR [--compile reduce-overhead|default|none]

``serve`` does what a real server's cold start does: import torch and transformers, load the
weights from DIR (model.safetensors), move them to the GPU, compile the forward pass with
torch.compile (mode reduce-overhead: CUDA graphs) and warm it up; then prints
``ready ... cudagraphs=on|off`` and, for every generated token, ``step N TOKENS t=EPOCH``.
Generation is greedy over a fixed window (batch x window tokens, the window slides by the
token generated), so the shapes never change (one CUDA graph) and every step's tokens depend
only on the weights and the step number: a restored server must print the same tokens as the
original did at the same steps.
"""

from __future__ import annotations

import time

T0 = time.time()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

# GPT-2 large: 36 layers, 1280 wide, 20 heads (774M parameters, 3.1 GB in fp32).
LARGE = dict(n_embd=1280, n_layer=36, n_head=20, n_positions=1024)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc's children lists; bench/children_probe.py uses it too)."""
    todo, found = [pid], []
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:  # ended meanwhile
            continue
        for task in tasks:
            try:
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    kids = [int(c) for c in fh.read().split()]
            except OSError:
                kids = []
            found += kids
            todo += kids
    return found


def setup(out: str, small: bool) -> int:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(**(dict(n_embd=64, n_layer=2, n_head=2, n_positions=256) if small else LARGE))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # random init on the GPU: seconds, not minutes
        model = GPT2LMHeadModel(cfg)
    model.save_pretrained(out, safe_serialization=True)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"wrote {out}: {size / 1e9:.2f} GB, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {time.time() - T0:.1f} s", flush=True)
    return 0


def serve(path: str, mode: str, batch: int, window: int, sleep: float, keep_compile_workers: bool = False) -> int:
    import torch
    from transformers import GPT2LMHeadModel

    t_import = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # The file is fp32; no dtype argument (its name changed between transformers 4 and 5).
    model = GPT2LMHeadModel.from_pretrained(path, use_safetensors=True).float().to(device).eval()
    t_load = time.time()

    def next_tokens(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits[:, -1, :].argmax(-1)

    fn = next_tokens
    compiled = "none"
    if mode != "none":
        try:
            fn = torch.compile(next_tokens, mode=mode, dynamic=False)
            compiled = mode
        except Exception as exc:  # report and serve eagerly: the bench says what happened
            print(f"torch.compile failed: {type(exc).__name__}: {exc}", flush=True)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, window), generator=gen).to(device)
    with torch.inference_mode():
        try:
            # The loop's own steps on a copy of the window: reduce-overhead records its CUDA graph
            # on the warm-up calls, and the window the loop builds is compiled for as well.
            w = ids
            for _ in range(3):
                w = torch.cat([w[:, 1:], fn(w)[:, None]], dim=1)
        except Exception as exc:
            print(f"compiled warm-up failed, serving eagerly: {type(exc).__name__}: {exc}", flush=True)
            fn, compiled = next_tokens, "none"
            fn(ids)
        if device == "cuda":
            torch.cuda.synchronize()
        # Compiling is done: stop inductor's pool of compile processes, as a server that has
        # warmed up would (they would otherwise sit in every checkpoint). With
        # --keep-compile-workers they stay, as in a server that never stops them: the pool's main
        # process reads the GPU's properties and forks its workers, which then hold the driver's
        # files, and gpusnap refuses the checkpoint (bench/results/gpu-h200-suite-2026-11-28-nineteenth).
        workers = "none"
        if keep_compile_workers:
            workers = f"kept ({len(descendants(os.getpid()))} processes)"
        else:
            try:
                from torch._inductor.async_compile import shutdown_compile_workers

                shutdown_compile_workers()
                workers = "stopped"
            except Exception as exc:  # an older or newer torch without it: say so, keep serving
                workers = f"kept ({type(exc).__name__})"
        graphs = "off"
        if compiled == "reduce-overhead" and device == "cuda":
            from torch._dynamo.utils import counters

            skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
            graphs = "on" if not skips else f"off (skipped {skips}x)"
        mem = torch.cuda.memory_reserved() if device == "cuda" else 0
        print(f"ready compile={compiled} cudagraphs={graphs} compile_workers={workers} import_s={t_import - T0:.1f} load_s={t_load - t_import:.1f} "
              f"warmup_s={time.time() - t_load:.1f} gpu_reserved_gb={mem / 1e9:.2f} t={time.time():.3f}", flush=True)
        step = 0
        while True:
            step += 1
            nxt = fn(ids)
            ids = torch.cat([ids[:, 1:], nxt[:, None]], dim=1)
            print(f"step {step} {'-'.join(str(int(t)) for t in nxt.tolist())} t={time.time():.3f}", flush=True)
            if sleep:
                time.sleep(sleep)


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup")
    s.add_argument("dir")
    s.add_argument("--small", action="store_true", help="a tiny model (tests on a CPU)")
    v = sub.add_parser("serve")
    v.add_argument("dir")
    v.add_argument("--compile", default="reduce-overhead", choices=["reduce-overhead", "default", "none"])
    v.add_argument("--keep-compile-workers", action="store_true", help="leave inductor's compile processes running once warm")
    v.add_argument("--batch", type=int, default=4)
    v.add_argument("--window", type=int, default=128)
    v.add_argument("--sleep", type=float, default=0.02)
    args = ap.parse_args()
    if args.cmd == "setup":
        return setup(args.dir, args.small)
    return serve(args.dir, args.compile, args.batch, args.window, args.sleep, args.keep_compile_workers)


if __name__ == "__main__":
    sys.exit(main())
