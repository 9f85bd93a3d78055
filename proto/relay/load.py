import os, sys, time, signal, multiprocessing as mp
mnt, pidfile, kills = sys.argv[1], sys.argv[2], int(sys.argv[3])
def reader(kind, q, stop):
    fails = 0; ops = 0; lat = []
    names = [f"nvidia{i}" for i in range(8)]
    i = 0
    while not stop.is_set():
        t = time.monotonic()
        try:
            if kind == 0: os.stat(f"{mnt}/{names[i%8]}")
            elif kind == 1: os.close(os.open(f"{mnt}/null", os.O_RDONLY))
            elif kind == 2: os.listdir(mnt)
            else: os.readlink(f"{mnt}/fd")
        except OSError as e:
            fails += 1
            if fails < 5: print("fail", kind, e, flush=True)
        lat.append(time.monotonic() - t); ops += 1; i += 1
    lat.sort()
    q.put((kind, ops, fails, lat[-1], lat[len(lat)//2], lat[int(len(lat)*0.99)]))
q = mp.Queue(); stop = mp.Event()
ps = [mp.Process(target=reader, args=(k, q, stop), daemon=True) for k in range(4)]
[p.start() for p in ps]
time.sleep(0.5)
for k in range(kills):
    keeper, server = open(pidfile).read().split()
    os.kill(int(server), signal.SIGKILL)
    # wait for the new server (pid file names it)
    while open(pidfile).read().split()[1] == server: time.sleep(0.001)
    time.sleep(0.2)
time.sleep(0.3)
stop.set()
for _ in ps:
    k, ops, fails, mx, p50, p99 = q.get()
    print(f"reader {k}: ops {ops} fails {fails} max {mx*1e3:.2f} ms p50 {p50*1e6:.1f} us p99 {p99*1e6:.1f} us")
[p.join() for p in ps]
