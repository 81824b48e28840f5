"""The dtype a training loop's forward and backward run fast in, on a given device.

bf16 autocast halves activation memory and, on CUDA or on a CPU whose bf16 matmuls torch
hands to oneDNN (AVX-512 with BF16/AMX, or AVX-512's emulation), runs at least as fast as
fp32. On other CPUs (AVX2 only: AMD Zen 2/3, many cloud VMs) torch's bf16 matmul falls back
to a reference loop ~50-100x slower than fp32 (measured on a Zen 3 EPYC: 0.29 GFLOP/s
against 17 GFLOP/s for a 256x512 @ 512x2048 product), so training there runs in fp32.

The examples, benchmarks and the demo ask ``choose(device, requested)``; an explicit
request always wins, and the reason says which was taken and why.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

#: Names a command line may give; "auto" asks ``choose`` to decide.
NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
         "float32": torch.float32, "fp32": torch.float32}


@dataclass(frozen=True)
class Choice:
    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def cpu_has_fast_bf16() -> bool:
    """Whether torch runs bf16 matmuls on this CPU through oneDNN (torch's own check,
    the one that routes them); False where torch cannot say."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:  # an op that is not registered in this build
        return False


def choose(device: str | torch.device = "cpu", requested: str | torch.dtype | None = None,
           fast_bf16: bool | None = None) -> Choice:
    """The autocast dtype for ``device``: ``requested`` when given (a dtype, or a name in
    ``NAMES``; "auto" or None to choose), else bf16 on CUDA or on a CPU with fast bf16
    (``fast_bf16`` overrides the detection, for tests), else fp32."""
    if isinstance(requested, str) and requested != "auto":
        if requested not in NAMES:
            raise ValueError(f"unknown compute dtype {requested!r}: use 'auto' or one of {sorted(NAMES)}")
        requested = NAMES[requested]
    if isinstance(requested, torch.dtype):
        if requested not in (torch.bfloat16, torch.float32):
            raise ValueError(f"compute dtype {requested} is not supported: use torch.bfloat16 or torch.float32")
        return Choice(requested, "as requested")
    device = torch.device(device)
    if device.type == "cuda":
        return Choice(torch.bfloat16, "CUDA runs bf16 matmuls natively")
    if device.type != "cpu":
        return Choice(torch.float32, f"no known fast bf16 path on {device.type}")
    capability = torch.backends.cpu.get_cpu_capability()
    if fast_bf16 if fast_bf16 is not None else cpu_has_fast_bf16():
        return Choice(torch.bfloat16, f"torch runs bf16 matmuls on this CPU through oneDNN ({capability})")
    return Choice(torch.float32, f"this CPU ({capability}) has no fast bf16 matmul in torch: "
                                 "its bf16 matmuls run ~50-100x slower than fp32")


def add_argument(parser) -> None:
    """``--dtype {auto,bfloat16,float32}`` on an argparse parser (default auto)."""
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                        help="autocast dtype of forward/backward (auto: bfloat16 on CUDA or "
                             "where the CPU runs it fast, else float32)")


def announce(device: str | torch.device, requested: str | None) -> Choice:
    """``choose`` for a command line: prints which dtype and why."""
    choice = choose(device, requested)
    print(f"forward/backward in {choice.name}: {choice.reason}", flush=True)
    return choice
