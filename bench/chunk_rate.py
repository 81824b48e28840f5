"""The host's update kernel on one chunk (1 Mi params: what the pipeline hands its pool per
ring slot, a resident sub-group's too) against one large slot (the probe's 112 Mi params),
per state format, on the default compute threads and on all 16 of the H100 host's cores:
how much of the probe's rate a resident step can get from its chunks.

    python bench/chunk_rate.py OUT.json
"""
import json
import sys

from smartinf import _native
from smartinf.planning.probe import measure_kernel

FORMATS = (("fp32", "fp32"), ("int8", "fp32"), ("int8", "split"), ("int4", "split"))


def main(out: str) -> None:
    rows = []
    for threads in (0, 16):
        for state, master in FORMATS:
            for numel in (1 << 20, 7 << 24):
                k = measure_kernel(numel, "bfloat16", "bfloat16", state, threads, master)
                rows.append(dict(threads=threads or _native.default_compute_threads(), state=state,
                                 master=master, numel=numel, gpps=k.params_per_s / 1e9))
                print(rows[-1], flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
