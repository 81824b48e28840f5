"""What watching for edits (smartinf/edits.py) costs where the params are on a GPU: the
digests of a GPT-2 XL-sized model's bf16 partitions (1.56 B params in sub-groups of 100 M,
DeepSpeed's layout) recorded and compared, as a step does, timed with the GPU synchronised.

    python bench/gpu_digest_cost.py [--params 1.56e9] [--subgroup 1e8]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from smartinf.step.edits import ParamWatch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--params", type=float, default=1.56e9)
    p.add_argument("--subgroup", type=float, default=1e8)
    p.add_argument("--rounds", type=int, default=10)
    a = p.parse_args()
    sizes = [int(a.subgroup)] * int(a.params // a.subgroup) + [int(a.params % a.subgroup)]
    flats = [torch.randn(n, device="cuda").to(torch.bfloat16) for n in sizes if n]
    watch = ParamWatch(lambda i: [flats[i]])
    keys = range(len(flats))
    for i in keys:
        watch.record(i)
    seconds = []
    for _ in range(a.rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        assert watch.changed(keys) == []  # the check at a step's start (one sync)
        for i in keys:  # the records as the step puts each sub-group
            watch.record(i)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    result = {"params": sum(sizes), "subgroups": len(flats), "device": torch.cuda.get_device_name(),
              "seconds_median": statistics.median(seconds[1:]), "seconds": seconds}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
