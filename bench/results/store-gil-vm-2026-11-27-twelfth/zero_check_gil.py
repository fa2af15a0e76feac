import numpy as np, time, threading, os, mmap
W=512; S=32
N=64
bufs=[]
for i in range(N):
    m=mmap.mmap(-1, 4<<20); m.write(os.urandom(4<<20)); bufs.append(m)
def A(mv):
    a=np.frombuffer(mv, dtype=np.uint64).reshape(-1, W); return ~a[:, ::S].any(axis=1)
def E(mv):
    a=np.frombuffer(mv, dtype=np.uint64).reshape(-1, W); s=np.ascontiguousarray(a[:, ::S]); return np.bitwise_or.reduce(s, axis=1) == 0
def F(mv):
    a=np.frombuffer(mv, dtype=np.uint64).reshape(-1, W); s=a[:, ::S]; return (s != 0).sum(axis=1) == 0
def G(mv):
    a=np.frombuffer(mv, dtype=np.uint64).reshape(-1, W); return np.logical_not(a[:, ::S].astype(bool).any(axis=1))
def H(mv):
    a=np.frombuffer(mv, dtype=np.uint64).reshape(-1, W); s=a[:, ::S]
    return s.max(axis=1) == 0
for f in (A,E,F,H):
    for m in bufs: assert (f(memoryview(m))==A(memoryview(m))).all()
    def loop(k):
        for _ in range(10):
            for m in bufs[k::2]: f(memoryview(m))
    t=time.perf_counter(); loop(0); loop(1); one=time.perf_counter()-t
    ts=[threading.Thread(target=loop, args=(k,)) for k in range(2)]
    t=time.perf_counter(); [x.start() for x in ts]; [x.join() for x in ts]; two=time.perf_counter()-t
    print(f.__name__, f"serial {one*1000:.0f} ms, 2 threads {two*1000:.0f} ms (GIL-free would be ~{one*500:.0f})")
