"""A deterministic workload whose state can be compared bit for bit at any step.

``python3 gpu_worker.py OUT``: every 10 steps appends ``<step> <value>`` to OUT (opened per
write: a host file held open is one CRIU cannot dump). Two runs agree at every step, so a
restored run can be checked against a fresh reference run.

- ``WORKER_MODE=cuda`` (default): a float32 tensor of ``GB`` GiB on the GPU, updated in place;
  the value is the sum of its 32-bit patterns (every bit of the tensor counts).
- ``WORKER_MODE=cpu``: a pure-Python generator, for CI hosts without a GPU (driver stand-in).

``STOP=N`` ends at step N; ``SLEEP`` seconds between steps (default 0.01).
"""

import os
import sys
import time

out_path = sys.argv[1]
mode = os.environ.get("WORKER_MODE", "cuda")
stop = int(os.environ.get("STOP", "0"))
pause = float(os.environ.get("SLEEP", "0.01"))


def emit(line: str) -> None:
    with open(out_path, "a") as fh:
        fh.write(line + "\n")


if mode == "cuda":
    import torch

    n = int(float(os.environ.get("GB", "1")) * (1 << 28))
    torch.manual_seed(0)
    x = torch.rand(n, device="cuda")
    torch.cuda.synchronize()

    def step() -> None:
        x.mul_(1.0000001).add_(1e-7)

    def value() -> int:
        # In chunks: a whole-tensor int64 sum would materialise a temporary twice the tensor's
        # size, which PyTorch's allocator then keeps, tripling the GPU memory the workload holds.
        torch.cuda.synchronize()
        bits = x.view(torch.int32)
        return sum(int(c.sum(dtype=torch.int64).item()) for c in bits.split(1 << 24))

elif mode == "managed":
    # CUDA managed (unified) memory, which the checkpoint API refuses: a small allocation only
    # (asking for more managed memory than is free can hang the GPU).
    from cuda.bindings import driver as cu

    cu.cuInit(0)
    _, dev = cu.cuDeviceGet(0)
    _, ctx = cu.cuDevicePrimaryCtxRetain(dev)
    cu.cuCtxSetCurrent(ctx)
    err, ptr = cu.cuMemAllocManaged(64 << 20, cu.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL.value)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    count = [0]

    def step() -> None:
        count[0] += 1

    def value() -> int:
        return count[0]

else:
    state = [12345]

    def step() -> None:
        state[0] = (state[0] * 6364136223846793005 + 1442695040888963407) % (1 << 64)

    def value() -> int:
        return state[0]


emit("ready")
i = 0
while True:
    step()
    i += 1
    if i % 10 == 0:
        emit(f"{i} {value()}")
        if stop and i >= stop:
            break
    if pause:
        time.sleep(pause)
