"""Head-to-head on this machine: DeepSpeed ZeRO-3 with ZeRO-Infinity's NVMe optimizer
offload (DeepSpeed's aio handle + DeepSpeedCPUAdam swap loop) against the smartinf
integration, same model (266 M params), same batches, same directory, same run.

Each mode is examples/deepspeed/train.py in its own process; per iteration it records
forward / backward / optimizer-step seconds and the bytes the process read from and
wrote to storage (/proc/self/io). The first iteration (warm-up) is dropped, the median of
the rest kept. Bytes per parameter bound the step: ZeRO-Infinity moves 32 B/param
(p, m, v read and written + the fp32 gradient written in backward and read in the step),
smartinf 24 B, so at storage speed the step speedup is at most 32/24 = 1.33.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from conftest import env_int, require_disk
from deepspeed_report import compare, summarize

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'smartinf[deepspeed]')")

ROOT = Path(__file__).resolve().parents[1]
MODEL = os.environ.get("SMARTINF_BENCH_DS_MODEL", "270m")
STEPS = env_int("SMARTINF_BENCH_DS_STEPS", 4)
# label -> train.py arguments; smartinf-int8 keeps Adam's moments 8-bit (6 B/param a way).
MODES = {"zero-infinity": ["--mode", "zero-infinity"], "smartinf": ["--mode", "smartinf"],
         "smartinf-int8": ["--mode", "smartinf", "--state-dtype", "int8"]}


def run(mode: str, directory: str, out: Path, args: list = (), steps: int = STEPS,
        env: Optional[dict] = None) -> dict:
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"), **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
           str(ROOT / "examples" / "deepspeed" / "train.py"), *(args or MODES[mode]),
           "--model", MODEL, "--dir", directory, "--steps", str(steps), "--batch", "1",
           "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{mode} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return json.loads(out.read_text())


def test_head_to_head_zero_infinity_vs_smartinf(bench_dir, storage_limits, summary, tmp_path):
    require_disk(bench_dir, 40 * 266 * 10 ** 6, "the DeepSpeed head-to-head")
    read_bw, write_bw = storage_limits.read_bw, storage_limits.write_bw
    results = {}
    for mode in MODES:
        directory = os.path.join(bench_dir, "deepspeed")
        record = run(mode, directory, tmp_path / f"{mode}.json")
        subprocess.run(["rm", "-rf", directory], check=False)  # both modes fit the disk
        results[mode] = summarize(record, read_bw, write_bw)
    zi, si = results["zero-infinity"], results["smartinf"]
    # Same model, same data, same first step: the modes agree before any update.
    assert abs(zi["losses"][0] - si["losses"][0]) <= 1e-5 * abs(zi["losses"][0])
    summary["deepspeed"] = dict(compare(results, read_bw, write_bw), model=MODEL)


# Updates during backward (overlap) against overlap=False: streamed states, and every state
# resident with room for twins (266 M x 12 B x 2); clipping off (a step after a clipped one
# starts nothing during backward).
OVERLAP_MODES = {
    "streamed": ["--mode", "smartinf", "--clip", "0"],
    "streamed-sync": ["--mode", "smartinf", "--clip", "0", "--no-overlap"],
    "resident": ["--mode", "smartinf", "--clip", "0", "--memory-budget", "7GiB"],
    "resident-sync": ["--mode", "smartinf", "--clip", "0", "--memory-budget", "7GiB", "--no-overlap"],
}


def test_updates_during_backward(bench_dir, storage_limits, summary, tmp_path):
    """Each mode twice, alternating with its overlap=False twin; medians of iterations 2+ of
    each run, then the median of the runs. The same losses, bit for bit."""
    require_disk(bench_dir, 30 * 266 * 10 ** 6, "the DeepSpeed overlap benchmark")
    read_bw, write_bw = storage_limits.read_bw, storage_limits.write_bw
    steps = env_int("SMARTINF_BENCH_DS_OVERLAP_STEPS", 6)
    runs: dict = {mode: [] for mode in OVERLAP_MODES}
    for round_ in range(2):
        for mode, args in OVERLAP_MODES.items():
            directory = os.path.join(bench_dir, "deepspeed-overlap")
            record = run(mode, directory, tmp_path / f"{mode}-{round_}.json", args, steps,
                         env={"SMARTINF_SPECULATE_ON_CPU": "1"})  # off by default on the CPU
            subprocess.run(["rm", "-rf", directory], check=False)
            runs[mode].append(summarize(record, read_bw, write_bw)
                              | {"speculative": [s["pipeline"]["speculative_updates"] for s in record["steps"]],
                                 "retracted": [s["pipeline"]["retracted_updates"] for s in record["steps"]],
                                 "deferred": [s["pipeline"]["deferred_updates"] for s in record["steps"]]})
    result = {}
    for mode, rs in runs.items():
        result[mode] = {k: statistics.median(r[k] for r in rs)
                        for k in ("fwd_s", "bwd_s", "step_s", "iteration_s")}
        result[mode]["runs"] = rs
    for mode in ("streamed", "resident"):
        assert runs[mode][0]["losses"] == runs[f"{mode}-sync"][0]["losses"], mode
        result[mode]["iteration_to_sync"] = result[mode]["iteration_s"] / result[f"{mode}-sync"]["iteration_s"]
        print(f"{mode}: iteration {result[mode]['iteration_s']:.2f} s against "
              f"{result[mode + '-sync']['iteration_s']:.2f} s without overlap "
              f"({result[mode]['iteration_to_sync']:.2f}x)")
    summary["deepspeed_overlap"] = dict(result, model=MODEL)
