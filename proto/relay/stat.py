import os, sys, time
p = sys.argv[1]; n = int(sys.argv[2])
best = []
for r in range(5):
    t = time.perf_counter()
    for _ in range(n): os.stat(p)
    best.append((time.perf_counter() - t) / n * 1e6)
best.sort(); print(p, "median us/stat", round(best[2], 2))
