"""What a streamed step draws from one disk, against the probe's mix curve for the same
directory in the same run: the ring alone (no framework), as DeepSpeed drives it.

    python bench/storage_ring.py DIR [--params 1557611200] [--formats int8_split,int4_split]
        [--schedules mixed,phased,auto] [--slots 0,16] [--queue-depths 0,64] [--steps 4]
        [--probe-mib 8192] [--out F.json]

Each format and schedule gets its own Pipeline on DIR (states streamed, bf16 params); the
sub-groups (``--subgroup``, DeepSpeed's 100 M by default) go in two at a time, as the
DeepSpeed front-end's two staging buffers send them. Steps alternate between the pipelines
(the disk drifts); the median of steps 2+ is reported as bytes read + written over the step
(GB/s), beside the probe's figure for that schedule (mixed: both directions at once;
phased: its best burst) and the ring's busy times and turns. Where the ring alone reaches
the probe's figure and a DeepSpeed step does not, the gap is the framework's; where the ring
does not, it is the ring's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys

import torch

import smartinf
from smartinf.planning import io_schedule, probe

FORMATS = {"fp32": {}, "int8": {"state_dtype": "int8"},
           "int8_split": {"state_dtype": "int8", "master": "split"},
           "int4_split": {"state_dtype": "int4", "master": "split"}}


class Run:
    """One pipeline over ``params`` bf16 params in sub-groups of ``subgroup``."""

    def __init__(self, directory: str, params: int, subgroup: int, fmt: str, schedule: str,
                 slots: int, depth: int):
        self.pipe = smartinf.Pipeline(directory, smartinf.AdamW(lr=1e-4, weight_decay=0.01),
                                      io_schedule=schedule, slots=slots or None,
                                      queue_depth=depth or None, if_exists="overwrite",
                                      **FORMATS[fmt])
        self.sizes = [min(subgroup, params - lo) for lo in range(0, params, subgroup)]
        for n in self.sizes:
            self.pipe.add_subgroup(n)
        self.grads = [torch.full((subgroup,), 1e-3, dtype=torch.bfloat16) for _ in range(2)]
        # A split master is sent each sub-group's own params: one buffer per sub-group.
        self.params = [torch.zeros(n, dtype=torch.bfloat16) for n in self.sizes]
        self.steps: list[dict] = []

    def step(self) -> None:
        self.steps.append(probe.ring_step(self.pipe, self.sizes, self.grads, self.params))

    def summary(self, storage: dict) -> dict:
        timed = self.steps[1:] or self.steps
        step = statistics.median(s["step_s"] for s in timed)
        median = min(timed, key=lambda s: abs(s["step_s"] - step))
        moved = median["storage_read"] + median["storage_write"]
        return {"step_s": step, "steps_s": [s["step_s"] for s in self.steps],
                "disk_bps": moved / median["step_s"], "bytes_moved": moved,
                "io_turns": median.get("io_turns", 0), "slots": self.pipe.stats["slots"],
                "busy_s": {k[5:]: v for k, v in median.items() if k.startswith("busy_")},
                "schedule": dataclasses.asdict(self.pipe.io_schedules[0]),
                "probe_bps": probe_figure(storage, self.pipe.io_schedules[0])}


def probe_figure(storage: dict, choice: io_schedule.Choice) -> float:
    """The probe's aggregate for the schedule the ring ran: mixed, or its turns' length
    (the ring's default 256 MiB where none was chosen)."""
    if choice.schedule == "mixed":
        return storage["mixed_bps"]
    burst = choice.burst or 256 << 20
    return dict((int(b), bps) for b, bps in storage["phased_bps"]).get(burst, float("nan"))


def depth_sweep(directory: str, mib: int, depths: list[int]) -> list[dict]:
    """The probe's stream (1 MiB requests) at each queue depth (0: the pipeline's): write,
    read and both at once (half each) over a file of ``mib`` MiB, bytes per second of each."""
    sweep = []
    for depth in depths:
        limit = probe.measure_storage(directory, mib << 20, mix_bursts=(), depth=depth or None)
        sweep.append({"depth": limit.depth, "write_bps": limit.write_bps,
                      "read_bps": limit.read_bps, "mixed_bps": limit.mixed_bps})
        print(f"queue depth {limit.depth}: write {limit.write_bps / 1e9:.2f} read "
              f"{limit.read_bps / 1e9:.2f} mixed {limit.mixed_bps / 1e9:.2f} GB/s", flush=True)
    return sweep


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("--params", type=int, default=1_557_611_200)
    p.add_argument("--subgroup", type=int, default=100_000_000)
    p.add_argument("--formats", default="int8_split,int4_split")
    p.add_argument("--schedules", default="mixed,phased,auto")
    p.add_argument("--slots", default="0", help="ring slots to try (0: the pipeline's choice)")
    p.add_argument("--queue-depths", default="0",
                   help="storage requests in flight per engine to try (0: the pipeline's choice)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--probe-mib", type=int, default=8192, help="0: use the directory's record")
    p.add_argument("--out")
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    if args.probe_mib:
        storage = dataclasses.asdict(probe.measure_storage(args.dir, args.probe_mib << 20))
        io_schedule.record(args.dir, storage)
    else:
        storage = io_schedule.load_record(io_schedule.find_record(args.dir), "run with --probe-mib")
    print(f"probe: read {storage['read_bps'] / 1e9:.2f} write {storage['write_bps'] / 1e9:.2f} "
          f"mixed {storage['mixed_bps'] / 1e9:.2f} phased "
          + ", ".join(f"{b >> 20} MiB {bps / 1e9:.2f}" for b, bps in storage["phased_bps"])
          + " GB/s", flush=True)
    depths = [int(d) for d in args.queue_depths.split(",")]
    if len(depths) > 1:
        storage["depth_sweep"] = depth_sweep(args.dir, args.probe_mib or 4096, depths)
    runs = {}
    try:
        for fmt in args.formats.split(","):
            for schedule in args.schedules.split(","):
                for slots in map(int, args.slots.split(",")):
                    for depth in depths:
                        name = f"{fmt}-{schedule}" + (f"-slots{slots}" if slots else "") + \
                            (f"-qd{depth}" if depth else "")
                        runs[name] = Run(os.path.join(args.dir, name), args.params, args.subgroup,
                                         fmt, schedule, slots, depth)
        for _ in range(args.steps):
            for name, run in runs.items():
                run.step()
                print(f"{name}: {run.steps[-1]['step_s']:.2f} s", flush=True)
        result = {"params": args.params, "subgroup": args.subgroup, "probe": storage,
                  "runs": {name: run.summary(storage) for name, run in runs.items()}}
    finally:
        for name, run in runs.items():
            run.pipe.close()
            shutil.rmtree(os.path.join(args.dir, name), ignore_errors=True)
    for name, r in result["runs"].items():
        print(f"{name:<18} step {r['step_s']:.2f} s  drawn {r['disk_bps'] / 1e9:.2f} GB/s "
              f"(probe {r['probe_bps'] / 1e9:.2f}: {r['disk_bps'] / r['probe_bps']:.2f}x)  turns "
              f"{r['io_turns']:.0f}  busy " + " ".join(f"{k} {v:.2f}" for k, v in r["busy_s"].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
