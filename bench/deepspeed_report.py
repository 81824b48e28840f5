"""Summaries and the plot of DeepSpeed head-to-head runs (records of examples/deepspeed/train.py).

    python bench/deepspeed_report.py OUT_PREFIX --read-gbps R --write-gbps W [NAME=]RECORD.json ...

writes OUT_PREFIX.json and OUT_PREFIX.png from records measured elsewhere (the GPU runs,
bench/gpu_headtohead.sh): per mode the medians of iterations 2+, the mean step over them
(a commit interval's durable commit included), and each mode's speedups over
ZeRO-Infinity and its ratio to ZeRO-Offload when those were run.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from smartinf.planning import placement

TRAFFIC_BOUND = 32 / 24  # storage B/param per iteration: ZeRO-Infinity / smartinf


def label(record: dict) -> str:
    return record["mode"] + (f" top-{record['topk']:.0%}" if record.get("topk") else "")


def summarize(record: dict, read_bw: float, write_bw: float) -> dict:
    """Medians over the iterations after the first (warm-up); the storage limit of the
    iteration's bytes at the bandwidths measured in the same run."""
    steps = record["steps"][1:]
    median = {k: statistics.median(s[k] for s in steps) for k in ("fwd_s", "bwd_s", "step_s")}
    # the host's disk: every rank's bytes where the record sums them (world > 1)
    for k in ("storage_read", "storage_written"):
        median[k] = statistics.median(s.get("host_" + k, s[k]) for s in steps)
    mean_step = statistics.mean(s["step_s"] for s in steps)
    # Where the step finishes during the next forward, its storage time is there too: the
    # forward's waits for its sub-groups (0 for the other modes and for DeepSpeed's). Writes
    # of background durable commits (resident states) fall outside both: such modes overstate.
    waits = statistics.median(s.get("pipeline", {}).get("gather_wait_s", 0.0) for s in steps)
    n = record["num_params"]
    # the model's iteration for the run's placement (examples/deepspeed/train.py records its
    # prediction where the states' directory has a probe record), from the forward and
    # backward measured without their waits for the pipeline, against the iteration
    # measured: means over the second commit interval where the run has one (its first
    # durable commit's writes and the next commit's wait for them), else over 2+
    k = (record.get("smartinf") or {}).get("commit_every") or 1
    window = record["steps"][k:2 * k] if k > 1 and len(record["steps"]) >= 2 * k else steps
    predicted = record.get("predicted")
    if predicted and "exposed_s" not in predicted:  # recorded before the model's iteration
        predicted = None
    fwd_bwd = statistics.mean(s["fwd_s"] - s.get("pipeline", {}).get("gather_wait_s", 0.0)
                              + s["bwd_s"] for s in window)
    measured_iteration = statistics.mean(s["fwd_s"] + s["bwd_s"] + s["step_s"] for s in window)
    model_iteration = predicted and placement.iteration_s(predicted["step_s"], predicted["exposed_s"],
                                                      fwd_bwd)
    limit = median["storage_read"] / read_bw + median["storage_written"] / write_bw
    # smartinf's step() by phase (host seconds; records since the phases were kept)
    phased = [s["step_phases"] for s in steps if s.get("step_phases")]
    phases = {k: statistics.median(p.get(k, 0.0) for p in phased) for k in phased[0]} if phased else {}
    # the wall time from one iteration's start to the next (records since the examples keep
    # ``start_s``): the phases leave out what runs between them (the records' own work, and
    # a step finishing on the optimizer's streams that no phase waited for)
    starts = [s["start_s"] for s in record["steps"] if "start_s" in s]
    wall = statistics.median(b - a for a, b in zip(starts[1:], starts[2:])) if len(starts) > 2 else None
    return {**median, "iteration_s": median["fwd_s"] + median["bwd_s"] + median["step_s"],
            "wall_iteration_s": wall,
            "mean_step_s": mean_step,
            "mean_iteration_s": median["fwd_s"] + median["bwd_s"] + mean_step,
            "smartinf": record.get("smartinf"),
            "storage_bytes_per_param": (median["storage_read"] + median["storage_written"]) / n,
            # what the step draws from the disk: bytes read + written over the step's seconds
            "disk_bps": (median["storage_read"] + median["storage_written"]) / (median["step_s"] + waits),
            # the same over backward too: ZeRO-Infinity writes its fp32 gradients during
            # backward, so over its step alone it seems to draw more than it does
            "disk_bps_with_backward": (median["storage_read"] + median["storage_written"])
            / (median["bwd_s"] + median["step_s"] + waits),
            "gather_wait_s": waits, "step_phases_s": phases,
            "model_step_s": predicted and predicted["step_s"],
            "model_window": [window[0]["step"], window[-1]["step"]],
            "fwd_bwd_without_waits_s": fwd_bwd, "measured_iteration_s": measured_iteration,
            # the iteration against its compute measured in the same run (issue 89: every GPU
            # record's ratio is to that): start to start where kept, else its phases
            "iteration_to_compute": (wall or median["fwd_s"] + median["bwd_s"] + median["step_s"]) / fwd_bwd,
            "model_iteration_s": model_iteration,
            "model_over_measured": model_iteration / measured_iteration if predicted else None,
            "storage_limit_s": limit, "params": n, "losses": [s["loss"] for s in record["steps"]]}


def compare(modes: dict, read_bw: float, write_bw: float) -> dict:
    """Every mode against the baselines run beside it: step and iteration speedups over
    ZeRO-Infinity, iteration (median and mean) as a ratio to ZeRO-Offload's; and the
    largest relative loss difference from ZeRO-Offload's over the iterations."""
    result = {"params": next(iter(modes.values()))["params"], "modes": modes,
              "traffic_bound": TRAFFIC_BOUND, "read_bytes_per_s": read_bw,
              "write_bytes_per_s": write_bw}
    zi, zo = modes.get("zero-infinity"), modes.get("zero-offload")
    for m in modes.values():
        if zi:
            m["step_speedup_over_zero_infinity"] = zi["step_s"] / m["step_s"]
            m["iteration_speedup_over_zero_infinity"] = zi["iteration_s"] / m["iteration_s"]
        if zo:
            m["iteration_to_zero_offload"] = m["iteration_s"] / zo["iteration_s"]
            m["mean_iteration_to_zero_offload"] = m["mean_iteration_s"] / zo["iteration_s"]
            m["max_loss_rel_diff_to_zero_offload"] = max(
                abs(a - b) / abs(b) for a, b in zip(m["losses"], zo["losses"]))
    if zi and "smartinf" in modes:  # the storage-only head-to-head of earlier runs
        result["step_speedup"] = zi["step_s"] / modes["smartinf"]["step_s"]
        result["iteration_speedup"] = zi["iteration_s"] / modes["smartinf"]["iteration_s"]
    return result


def plot(plt, ds: dict, path: str) -> None:
    """Stacked fwd / bwd / step seconds per mode, and storage bytes per param."""
    modes = list(ds["modes"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = [0.0] * len(modes)
    for phase in ("fwd_s", "bwd_s", "step_s"):
        values = [ds["modes"][m][phase] for m in modes]
        ax1.bar(modes, values, 0.5, bottom=bottom, label=phase[:-2])
        bottom = [b + v for b, v in zip(bottom, values)]
    ax1.set_ylabel("seconds per iteration (median)")
    ax1.set_title(f"ZeRO-3, {ds['params'] / 1e6:.0f} M params (medians of iterations 2+)",
                  fontsize=10)
    ax1.tick_params(axis="x", labelrotation=30, labelsize=7)
    ax2.tick_params(axis="x", labelrotation=30, labelsize=7)
    ax1.legend(fontsize=8)
    ax2.bar(modes, [ds["modes"][m]["storage_bytes_per_param"] for m in modes], 0.5)
    ax2.set_ylabel("storage bytes per param per iteration")
    ax2.set_title("storage traffic", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--read-gbps", type=float, required=True)
    p.add_argument("--write-gbps", type=float, required=True)
    p.add_argument("records", nargs="+")
    args = p.parse_args()
    rb, wb = args.read_gbps * 1e9, args.write_gbps * 1e9
    modes = {}
    for arg in args.records:
        name, _, path = arg.rpartition("=")
        record = json.loads(Path(path).read_text())
        modes[name or label(record)] = summarize(record, rb, wb)
    report = compare(modes, rb, wb)
    Path(args.out + ".json").write_text(json.dumps(report, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plot(plt, report, args.out + ".png")
    for name, m in modes.items():
        print(f"{name:<20} fwd {m['fwd_s']:6.2f}  bwd {m['bwd_s']:6.2f}  step {m['step_s']:6.2f}  "
              f"iteration {m['iteration_s']:6.2f} s  storage {m['storage_bytes_per_param']:5.1f} B/param"
              f"  {m['disk_bps'] / 1e9:4.2f} GB/s  limit {m['storage_limit_s']:6.2f} s"
              f"  mean step {m['mean_step_s']:6.2f} s"
              f"  {m['iteration_to_compute']:4.2f}x compute ({m['fwd_bwd_without_waits_s']:.2f} s)"
              + (f"  x ZI {m['iteration_speedup_over_zero_infinity']:5.2f}"
                 if "iteration_speedup_over_zero_infinity" in m else "")
              + (f"  / ZO {m['iteration_to_zero_offload']:4.2f} (mean {m['mean_iteration_to_zero_offload']:4.2f})"
                 f"  loss diff {m['max_loss_rel_diff_to_zero_offload']:.1e}"
                 if "iteration_to_zero_offload" in m else "")
              + (f"  model iteration {m['model_iteration_s']:5.2f} s vs {m['measured_iteration_s']:5.2f}"
                 f" over {m['model_window'][0]}-{m['model_window'][1]} ({m['model_over_measured']:4.2f}x)"
                 if m["model_step_s"] else "")
              + ("  step() " + " ".join(f"{k[:-2]} {v:.2f}" for k, v in m["step_phases_s"].items()
                                        if v >= 0.005) if m["step_phases_s"] else ""))


if __name__ == "__main__":
    main()
