"""Training workload for bench/e2e.py: GPT-2 small (124M) with AdamW on random-seeded tokens.

    python3 gpt2_train.py [--batch 16] [--seq 1024]

fp32, batch 16 x 1024 tokens holds about 20 GB of GPU memory (weights, gradients, AdamW's two
moments, activations). Prints ``ready ...`` then ``step N LOSS t=EPOCH`` per step. The data of
step N comes from a generator seeded with N and the kernels are the deterministic ones, so a
restored run must print the original run's losses at the same steps.
"""

from __future__ import annotations

import time

T0 = time.time()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed by deterministic cuBLAS


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--small", action="store_true", help="a tiny model (tests on a CPU)")
    ap.add_argument("--sleep", type=float, default=0.0)
    args = ap.parse_args()
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = GPT2Config(**(dict(n_embd=64, n_layer=2, n_head=2, n_positions=args.seq) if args.small else dict(n_positions=max(1024, args.seq))))
    with torch.device(device):
        model = GPT2LMHeadModel(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    step = 0
    while True:
        step += 1
        gen = torch.Generator(device=device).manual_seed(step)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen, device=device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients stay allocated, as in most training loops
        value = loss.item()
        if step == 1:
            mem = torch.cuda.max_memory_reserved() if device == "cuda" else 0
            print(f"ready params_m={sum(p.numel() for p in model.parameters()) / 1e6:.0f} gpu_reserved_gb={mem / 1e9:.2f} "
                  f"startup_s={time.time() - T0:.1f} t={time.time():.3f}", flush=True)
        print(f"step {step} {value:.6f} t={time.time():.3f}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)


if __name__ == "__main__":
    sys.exit(main())
