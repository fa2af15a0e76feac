"""A deterministic workload whose state can be compared bit for bit at any step.

``python3 gpu_worker.py OUT``: every 10 steps appends ``<step> <value>`` to OUT (opened per
write: a host file held open is one CRIU cannot dump). Two runs agree at every step, so a
restored run can be checked against a fresh reference run.

- ``WORKER_MODE=cuda`` (default): a float32 tensor of ``GB`` GiB on the GPU, updated in place;
  the value is the sum of its 32-bit patterns (every bit of the tensor counts). With
  ``WORKER_GPUS=N`` (default 1): one such tensor on each of the first N GPUs, each with its own
  seed, and the value joins their sums (so every GPU's every bit counts).
- ``WORKER_MODE=loader``: a PyTorch training loop with DataLoader worker processes forked after
  CUDA initialised (``LOADER_WORKERS``, default 2; ``LOADER_START=spawn`` or ``forkserver``
  starts them afresh instead), pinned batches, a CUDA graph, a side
  stream, a second host thread on its own stream and allocator churn, besides ``GB`` GiB of
  ballast; a self-check that fails writes ``FAIL ...`` and exits 3.
- ``WORKER_MODE=compiled``: a torch.compile'd step with inductor's compile processes running
  until a file ``stop-compile-workers`` appears beside OUT (then stopped, and a line says so).
- ``WORKER_MODE=cpu``: a pure-Python generator, for CI hosts without a GPU (driver stand-in).

``STOP=N`` ends at step N; ``SLEEP`` seconds between steps (default 0.01).
"""

import os
import sys
import time


class LoaderBatches:
    """The loader mode's dataset: sample ``i`` is drawn from a generator seeded with ``i``. At
    module level, so that workers started with spawn or forkserver find it (they import this
    file as ``__mp_main__``, which is why everything else runs in :func:`main`)."""

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        import torch

        x = torch.randn(256, generator=torch.Generator().manual_seed(i))
        return x, torch.roll(x, 1)


def bits_value(tensors) -> int:  # type: ignore[no-untyped-def]
    """The checked value of GPU tensors: the sum of each one's 32-bit patterns (every bit
    counts), joined 64 bits apart, once all work on their devices has ended."""
    import torch

    total = 0
    for x in tensors:
        torch.cuda.synchronize(x.device)
        bits = x.detach().contiguous().view(torch.int32).flatten()
        # In chunks: a whole-tensor int64 sum would materialise a temporary twice the tensor's
        # size, which PyTorch's allocator then keeps, tripling the GPU memory the workload holds.
        total = (total << 64) + sum(int(c.sum(dtype=torch.int64).item()) for c in bits.split(1 << 24))
    return total


def main() -> None:
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
        gpus = int(os.environ.get("WORKER_GPUS", "1"))
        if gpus == 1:
            torch.manual_seed(0)
            xs = [torch.rand(n, device="cuda")]
        else:
            xs = [torch.rand(n, device=f"cuda:{i}", generator=torch.Generator(device=f"cuda:{i}").manual_seed(i)) for i in range(gpus)]
        for i in range(gpus):
            torch.cuda.synchronize(i)

        def step() -> None:
            for x in xs:
                x.mul_(1.0000001).add_(1e-7)

        def value() -> int:
            return bits_value(xs)

    elif mode == "loader":
        # A training loop as PyTorch users write it: the model on the GPU first, then a DataLoader
        # whose worker processes are forked after CUDA is initialised (they inherit the driver's
        # open device files but hold no CUDA context), batches pinned by the loader's own thread and
        # copied asynchronously, a CUDA graph replayed, a copy stream whose pinned result is checked
        # against a synchronous copy, a second host thread doing CUDA work on its own stream, and
        # the caching allocator churning. Deterministic, so a restored run matches a reference run.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        import collections
        import queue
        import threading

        import torch
        from torch.utils.data import DataLoader

        torch.use_deterministic_algorithms(True)
        torch.manual_seed(0)
        ballast = torch.rand(int(float(os.environ.get("GB", "1")) * (1 << 28)), device="cuda")
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 256)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        wg = torch.randn(256, 256, device="cuda") / 16

        workers = int(os.environ.get("LOADER_WORKERS", "2"))
        start = os.environ.get("LOADER_START", "fork")  # how the loader's worker processes start
        batches = iter(DataLoader(LoaderBatches(), batch_size=32, num_workers=workers, pin_memory=True,
                                  persistent_workers=workers > 0, prefetch_factor=4 if workers else None,
                                  multiprocessing_context=start if workers else None))

        static_x = torch.zeros(32, 256, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                static_y = torch.tanh(static_x @ wg)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = torch.tanh(static_x @ wg)

        acc = torch.full((256, 256), 1 / 256, device="cuda")
        jobs: "queue.Queue[int]" = queue.Queue()
        dones: "queue.Queue[int]" = queue.Queue()

        def helper() -> None:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                while True:
                    k = jobs.get()
                    acc.copy_(torch.tanh(acc @ wg + k * 1e-3))
                    s.synchronize()
                    dones.put(k)

        threading.Thread(target=helper, daemon=True).start()
        copier = torch.cuda.Stream()
        pinned = torch.empty(256, 512, pin_memory=True)
        copied = torch.cuda.Event()
        churn: "collections.deque[torch.Tensor]" = collections.deque()
        last = [None, 0]  # the snapshot copied into ``pinned``, step count

        def step() -> None:
            k = last[1] = last[1] + 1
            if last[0] is not None:
                copied.synchronize()
                if not torch.equal(pinned, last[0].cpu()):
                    emit(f"FAIL step {k}: the pinned asynchronous copy differs from a synchronous copy")
                    sys.exit(3)
            x, y = next(batches)
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            static_x.copy_(x)
            graph.replay()
            loss = torch.nn.functional.mse_loss(model(x + static_y), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            ballast.mul_(1.0000001).add_(1e-7)
            jobs.put(k)
            if dones.get() != k:
                emit(f"FAIL step {k}: the helper thread answered out of turn")
                sys.exit(3)
            churn.append(torch.empty((1 + k * 7 % 48) << 18, device="cuda").fill_(k % 5))
            if len(churn) > 6:
                churn.popleft()
            snap = model[2].weight.detach().clone()
            copier.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(copier):
                pinned.copy_(snap, non_blocking=True)
                copied.record(copier)
            snap.record_stream(copier)
            last[0] = snap

        def value() -> int:
            return bits_value([ballast, acc, static_y, *model.parameters()])

    elif mode == "compiled":
        # A torch.compile'd step, as a compiled server runs it, with inductor's pool of compile
        # processes left running (its default), until ``stop-compile-workers`` appears next to
        # OUT: then the pool is stopped, as a server may do once warm, and a line says so.
        import torch

        torch.manual_seed(0)
        ballast = torch.rand(int(float(os.environ.get("GB", "1")) * (1 << 28)), device="cuda")
        a = torch.rand(512, 512, device="cuda")
        b = torch.randn(512, 512, device="cuda") / 32
        fn = torch.compile(lambda x, y: torch.tanh(x @ y) * 0.5 + x * 0.5)
        stop_file = os.path.join(os.path.dirname(os.path.abspath(out_path)), "stop-compile-workers")
        stopped = [False]

        def step() -> None:
            a.copy_(fn(a, b))
            ballast.mul_(1.0000001).add_(1e-7)
            if not stopped[0] and os.path.exists(stop_file):
                from torch._inductor.async_compile import shutdown_compile_workers

                shutdown_compile_workers()
                stopped[0] = True
                emit("compile workers stopped")

        def value() -> int:
            return bits_value([ballast, a])

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


if __name__ == "__main__":
    main()
