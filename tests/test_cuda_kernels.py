"""The GPU update kernels (src/native/device/cuda_update.cu: the functions of
src/native/kernels/ compiled for the GPU) give the bits the same functions give on the host:
tests/cuda/kernels_match.cu, built here with nvcc, runs every rule, (gradient, param) dtype
pair, fp32 and split master, on a million params each. Needs nvcc and a CUDA GPU (the lent
GPU machine: bench/gpu_kit.sh); skipped elsewhere."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "src" / "native"


def nvcc() -> str:
    found = shutil.which("nvcc") or (
        os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if "CUDA_HOME" in os.environ else None)
    if not found or not os.path.exists(found):
        pytest.skip("no CUDA toolkit (nvcc) here")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here")
    return found


def built_and_run(exe: Path, sources: list, flags: list, timeout: int) -> str:
    """Builds ``sources`` (tests/cuda/ and src/native/ files) with nvcc into ``exe``, runs it;
    its output, once both succeeded."""
    built = subprocess.run(
        [nvcc(), "-std=c++17", "-O2", "-arch=native", "-diag-suppress", "1675", f"-I{NATIVE}",
         *map(str, sources), *flags, "-o", str(exe)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-4000:]
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=timeout)
    print(ran.stdout[-4000:])
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-2000:]
    return ran.stdout


def test_gpu_kernels_match_the_host_bit_for_bit(tmp_path):
    # -fmad=false: a * b + c stays two roundings, as on the host; division and square root
    # are correctly rounded by nvcc's defaults (-prec-div, -prec-sqrt).
    out = built_and_run(tmp_path / "kernels_match", [ROOT / "tests" / "cuda" / "kernels_match.cu",
                                                     NATIVE / "device" / "cuda_update.cu"],
                        ["-fmad=false"], 600)
    assert ", 0 differ" in out


def test_gpu_params_checksum_matches_the_host(tmp_path):
    """A split master's params checksum hashed in GPU memory (device/cuda_checksum.cu, for
    params that never leave the GPU) is the host's: XXH3 of every piece, lane by lane."""
    out = built_and_run(tmp_path / "checksum_match", [ROOT / "tests" / "cuda" / "checksum_match.cu",
                                                      NATIVE / "device" / "cuda_checksum.cu"],
                        [f"-I{ROOT / 'third_party' / 'xxhash'}"], 120)  # store/checksum.h inlines it
    assert "48 cases, 0 differ" in out
