"""How the store's durability pattern costs on this disk: 4 writers, 32 MiB files (the store's packs),
4 GiB in all; each file fdatasynced / none then one syncfs / with sync_file_range kicks every 8 MiB."""
import ctypes, mmap, os, random, subprocess, threading, time
D = "/var/tmp/syncprobe"; os.makedirs(D, exist_ok=True)
TOTAL = 4 << 30; FILE = 32 << 20; BLK = 8 << 20; W = 4
buf = mmap.mmap(-1, BLK); buf.write(random.Random(1).randbytes(BLK))
libc = ctypes.CDLL(None, use_errno=True)
print(subprocess.run("findmnt -no FSTYPE,OPTIONS -T /var/tmp; cat /sys/block/vda/queue/write_cache 2>/dev/null", shell=True, capture_output=True, text=True).stdout, flush=True)
def run(name, per_file_sync, kick, syncfs_end, file_size=FILE, writers=W):
    os.sync()
    files = TOTAL // file_size
    def w(k):
        for i in range(k, files, writers):
            fd = os.open(f"{D}/f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            off = 0
            for _ in range(file_size // BLK):
                os.write(fd, buf)
                if kick:
                    libc.sync_file_range(fd, ctypes.c_longlong(off), ctypes.c_longlong(BLK), 2)
                off += BLK
            if per_file_sync:
                os.fdatasync(fd)
            os.close(fd)
    t = time.perf_counter()
    ts = [threading.Thread(target=w, args=(k,)) for k in range(writers)]
    [x.start() for x in ts]; [x.join() for x in ts]
    mid = time.perf_counter() - t
    if syncfs_end:
        fd = os.open(D, os.O_RDONLY); libc.syncfs(fd); os.close(fd)
    s = time.perf_counter() - t
    print(f"{name}: {TOTAL/1e9/s:.2f} GB/s ({s:.2f} s, writes done at {mid:.2f} s)", flush=True)
    for i in range(files): os.unlink(f"{D}/f{i}")
for rep in range(2):
    run("32 MiB files, fdatasync each", True, False, False)
    run("32 MiB files, fdatasync each, kicks every 8 MiB", True, True, False)
    run("32 MiB files, one syncfs at the end", False, False, True)
    run("32 MiB files, kicks, one syncfs at the end", False, True, True)
    run("1 GiB files, fdatasync each", True, False, False, file_size=1 << 30)
os.rmdir(D)
