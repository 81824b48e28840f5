"""What a background durable commit gets from a disk: the probe's plain write against the
same bytes written while the host's update runs back to back on the compute threads
(``probe.measure_storage(update_numel=...)``), rounds alternating (the disk drifts).

    python bench/write_beside_update.py DIR OUT.json [--size-mib 4096] [--rounds 3]
"""
import argparse
import json
import statistics

from smartinf import _native
from smartinf.planning import probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("out")
    parser.add_argument("--size-mib", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    # the probe's parallel kernel size: 16 Mi params per two compute threads
    numel = probe.KERNEL_NUMEL * max(1, _native.default_compute_threads() // 2)
    rounds = []
    for _ in range(args.rounds):
        limit = probe.measure_storage(args.directory, args.size_mib * probe.MiB, mix=False,
                                      update_numel=numel)
        rounds.append({"write_bps": limit.write_bps, "read_bps": limit.read_bps,
                       "write_beside_update_bps": limit.write_beside_update_bps})
        print(rounds[-1], flush=True)
    summary = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    summary["beside_over_plain"] = summary["write_beside_update_bps"] / summary["write_bps"]
    kernel = probe.measure_kernel(numel, "bfloat16", "bfloat16", threads=0)
    result = {"directory": args.directory, "nbytes": args.size_mib * probe.MiB,
              "update_numel": numel, "compute_threads": _native.default_compute_threads(),
              "usable_cores": probe.usable_cores(), "kernel_params_per_s": kernel.params_per_s,
              "rounds": rounds, "median": summary}
    print(json.dumps(result["median"]))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
