"""PCIe each way alone and both at once (pinned, 1 GiB, best of 5), on the lent GPU: the link's rate
that bounds the states a GPU updates in host memory (docs/deepspeed.md). python3 bench/gpu_pcie.py OUT.json"""
import json, sys, time, torch
n = 1 << 30
h1 = torch.empty(n, dtype=torch.uint8, pin_memory=True); h2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
g1 = torch.empty(n, dtype=torch.uint8, device="cuda"); g2 = torch.empty(n, dtype=torch.uint8, device="cuda")
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
def best(f):
    t = []
    for _ in range(6):
        torch.cuda.synchronize(); a = time.perf_counter(); f(); torch.cuda.synchronize(); t.append(time.perf_counter() - a)
    return min(t[1:])
def both():
    with torch.cuda.stream(s1): g1.copy_(h1, non_blocking=True)
    with torch.cuda.stream(s2): h2.copy_(g2, non_blocking=True)
r = {"h2d_GBps": n / best(lambda: g1.copy_(h1, non_blocking=True)) / 1e9,
     "d2h_GBps": n / best(lambda: h2.copy_(g2, non_blocking=True)) / 1e9,
     "both_each_way_GBps": n / best(both) / 1e9, "gpu": torch.cuda.get_device_name()}
print(json.dumps(r)); open(sys.argv[1], "w").write(json.dumps(r))
