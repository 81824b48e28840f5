"""The forward/backward dtype the demo, examples and benchmarks train in: bf16 only where
the device runs it fast (CUDA, or a CPU whose bf16 matmuls torch hands to oneDNN), fp32
otherwise; an explicit choice wins."""
import sys
from pathlib import Path

import pytest
import torch

from smartinf.planning import compute_dtype

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples.gpt
from examples.gpt import train as gpt  # noqa: E402

TINY = gpt.TrainConfig(batch_size=2, seq_len=8, d_model=32, n_layer=1, n_head=2, n_topics=1)


def test_a_cpu_without_fast_bf16_trains_in_fp32():
    choice = compute_dtype.choose("cpu", fast_bf16=False)
    assert choice.dtype == torch.float32
    assert "no fast bf16" in choice.reason and torch.backends.cpu.get_cpu_capability() in choice.reason


def test_a_cpu_with_fast_bf16_and_cuda_train_in_bf16():
    assert compute_dtype.choose("cpu", fast_bf16=True).dtype == torch.bfloat16
    assert compute_dtype.choose("cuda").dtype == torch.bfloat16  # no GPU needed to decide


def test_this_cpu_is_asked_with_torchs_own_check():
    expected = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert compute_dtype.cpu_has_fast_bf16() == expected
    assert compute_dtype.choose("cpu").dtype == (torch.bfloat16 if expected else torch.float32)


@pytest.mark.parametrize("requested, dtype", [
    ("bfloat16", torch.bfloat16), ("float32", torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_an_explicit_dtype_wins(requested, dtype):
    for fast in (False, True):
        choice = compute_dtype.choose("cpu", requested, fast_bf16=fast)
        assert (choice.dtype, choice.reason) == (dtype, "as requested")


@pytest.mark.parametrize("requested, match", [("half", "unknown compute dtype 'half'"),
                                              (torch.float16, "use torch.bfloat16 or torch.float32")])
def test_an_unknown_dtype_is_named(requested, match):
    with pytest.raises(ValueError, match=match):
        compute_dtype.choose("cpu", requested)


@pytest.mark.parametrize("fast, expected", [(False, torch.float32), (True, torch.bfloat16)])
def test_the_demo_gpt_trains_in_the_chosen_dtype(monkeypatch, fast, expected):
    """The demo's train() with no dtype asks the detection (forced here both ways)."""
    monkeypatch.setattr(compute_dtype, "cpu_has_fast_bf16", lambda: fast)
    result = gpt.train(lambda params: torch.optim.AdamW(params, lr=1e-3), 2, TINY)
    assert result["dtype"] == str(expected)
    assert len(result["losses"]) == 2 and all(map(torch.isfinite, torch.tensor(result["losses"])))


def test_the_demo_command_line_says_which_dtype_and_why(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(compute_dtype, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setattr(gpt, "TrainConfig", lambda: TINY)
    gpt.main(["--steps", "1", "--runs", "torch", "--out", str(tmp_path / "l.png")])
    out = capsys.readouterr().out
    assert "forward/backward in float32: this CPU" in out and "float32 forward/backward" in out
