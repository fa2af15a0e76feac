"""Disk write probe: buffered vs O_DIRECT, 1..8 writers, random data (4 GiB per case)."""
import mmap, os, random, subprocess, sys, threading, time
D = "/var/tmp/diskprobe"; os.makedirs(D, exist_ok=True)
TOTAL = 4 << 30; BLK = 8 << 20
buf = mmap.mmap(-1, BLK); buf.write(random.Random(1).randbytes(BLK))
print(subprocess.run("df -h /var/tmp | tail -1; lsblk -d -o NAME,SIZE,ROTA,MODEL", shell=True, capture_output=True, text=True).stdout)
def writer(path, n, direct, sync):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o600)
    mv = memoryview(buf)
    for _ in range(n): os.write(fd, mv)
    if sync: os.fdatasync(fd)
    os.close(fd)
def case(streams, direct):
    subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True)
    n = TOTAL // BLK // streams
    ts = [threading.Thread(target=writer, args=(f"{D}/f{i}", n, direct, True)) for i in range(streams)]
    t = time.perf_counter(); [x.start() for x in ts]; [x.join() for x in ts]; s = time.perf_counter() - t
    print(f"{'O_DIRECT' if direct else 'buffered+fdatasync'} {streams} writers: {TOTAL/1e9/s:.2f} GB/s", flush=True)
    for i in range(streams): os.unlink(f"{D}/f{i}")
for direct in (False, True):
    for streams in (1, 4, 8):
        case(streams, direct)
os.rmdir(D)
