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
import subprocess
import sys
from pathlib import Path

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


def run(mode: str, directory: str, out: Path) -> dict:
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
           str(ROOT / "examples" / "deepspeed" / "train.py"), *MODES[mode],
           "--model", MODEL, "--dir", directory, "--steps", str(STEPS), "--batch", "1",
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
