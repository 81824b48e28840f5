"""The Hugging Face path: examples/huggingface/train.py (a small GPT-2 built from a config)
with the transformers Trainer and a DeepSpeed ZeRO-3 config holding a "smartinf" block,
with Trainer(optimizers=...) and with Accelerate, each against the same run without
smartinf, and each resumed from its mid-run checkpoint against the uninterrupted run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import warm
from conftest import free_port

pytest.importorskip("transformers", reason="the Hugging Face extra is not installed (pip install 'smartinf[hf]')")
pytest.importorskip("accelerate", reason="the Hugging Face extra is not installed (pip install 'smartinf[hf]')")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "huggingface" / "train.py"
sys.path.insert(0, str(ROOT))
from examples.huggingface.train import LR  # noqa: E402  (its constant schedule's rate)


WARM = {"hf": ("torch", "examples.huggingface.train", "accelerate"),
        # DeepSpeed's optimizer check imports its Muon: torch.compile's stack
        "hf-deepspeed": ("torch", "examples.huggingface.train", "accelerate", "transformers.trainer",
                         "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer")}


def run(tmp: Path, name: str, via: str, *, mode: str = "smartinf", world: int = 1,
        resume_from: str = "", states: str = "", extra: tuple = (), fresh: bool = False) -> dict:
    """Runs the example; returns its losses and final fp32 weights. ``fresh``: launched by
    torch.distributed.run (or python) itself, as users launch it, not from a warm process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"
    # torchrun --nproc_per_node=world (or python) SCRIPT ..., forked from a warm process
    # (tests/warm.py) that imported what the example's runs import before their first line
    torchrun = world > 1 or via == "trainer-deepspeed"
    argv = [SCRIPT, "--via", via, "--mode", mode, "--dir", states or str(tmp / name),
            "--checkpoints", str(tmp / name / "checkpoints"), "--out", str(tmp / f"{name}.json")]
    if resume_from:
        argv += ["--resume-from", resume_from]
    argv += list(extra)
    kind = "hf-deepspeed" if via == "trainer-deepspeed" else "hf"
    done = warm.run(kind, WARM[kind], argv, world=world if torchrun else None, env=env,
                    port=free_port(), fresh_=fresh)
    assert done.returncode == 0, f"{' '.join(done.args)}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    result = json.loads((tmp / f"{name}.json").read_text())
    result["weights"] = torch.load(tmp / f"{name}.pt")
    result["log"] = done.stdout + done.stderr
    return result


def noise_driven(key: str, value: torch.Tensor) -> torch.Tensor:
    """Elements whose gradient is zero in exact arithmetic: GPT-2's attention key bias
    (``c_attn.bias[n_embd:2 n_embd]``). It shifts all of a query's scores by q.b, which the
    softmax ignores, so its gradient is rounding noise, and Adam scales noise up to steps of
    ~lr: a 1-ulp difference anywhere (torch's CPU kernels round differently per instruction
    set: docs/correctness.md, "How close to torch") moves these elements by O(lr) per step."""
    mask = torch.zeros_like(value, dtype=torch.bool)
    if key.endswith("attn.c_attn.bias"):
        third = value.numel() // 3
        mask[third:2 * third] = True
    return mask


def assert_same_run(ours: dict, theirs: dict, rtol: float) -> None:
    """Losses and weights within ``rtol``, but for noise-driven elements (above), which can
    only be promised within what Adam's steps can move them apart: each run moves an
    element by at most lr (1 - beta1) / sqrt(1 - beta2) per step (Kingma & Ba, sec. 2.1)."""
    steps = len(ours["losses"])
    assert steps == len(theirs["losses"]) == 8
    for a, b in zip(ours["losses"], theirs["losses"]):
        assert abs(a - b) <= rtol * abs(b), (ours["losses"], theirs["losses"])
    adam_bound = 2 * steps * LR * (1 - 0.9) / (1 - 0.999) ** 0.5
    for key, value in theirs["weights"].items():
        noise = noise_driven(key, value)
        torch.testing.assert_close(ours["weights"][key][~noise], value[~noise], rtol=rtol, atol=rtol, msg=key)
        assert torch.all((ours["weights"][key][noise] - value[noise]).abs() <= adam_bound), key


@pytest.mark.parametrize("via", ["trainer-optimizers", "accelerate"])
def test_optimizer_through_trainer_and_accelerate(tmp_path, via):
    ours = run(tmp_path, "ours", via)
    assert_same_run(ours, run(tmp_path, "torch", via, mode="reference"), 1e-5)
    # Resumed from the step-4 checkpoint, in a fresh process, over the same states directory:
    # the same steps 5-8 as the uninterrupted run (fp32 masters travel in optimizer.pt).
    resumed = run(tmp_path, "resumed", via, states=str(tmp_path / "ours"),
                  resume_from=str(tmp_path / "ours" / "checkpoints" / "checkpoint-4"))
    assert resumed["losses"][-4:] == ours["losses"][-4:]
    for key, value in ours["weights"].items():
        assert torch.equal(resumed["weights"][key], value), key


@pytest.mark.parametrize("world", [1, 2])
def test_trainer_with_a_deepspeed_config_holding_a_smartinf_block(tmp_path, world):
    """TrainingArguments(deepspeed=config): the block takes effect through the import alone
    (the states directory fills), the run equals ZeRO-3 with DeepSpeed's CPU offload, the
    Trainer's checkpoints (saved twice per tag by the Trainer) resume exactly, and
    zero_to_fp32 consolidates the fp32 weights."""
    via = "trainer-deepspeed"
    ours = run(tmp_path, "ours", via, world=world, fresh=world == 2)  # (as users launch it)
    for rank in range(world):
        assert (tmp_path / "ours" / f"rank{rank:05d}" / "states.bin").stat().st_size > 0
    assert_same_run(ours, run(tmp_path, "ref", via, mode="reference", world=world), 1e-5)
    resumed = run(tmp_path, "resumed", via, world=world, states=str(tmp_path / "ours"),
                  resume_from=str(tmp_path / "ours" / "checkpoints" / "checkpoint-4"))
    assert resumed["losses"][-4:] == ours["losses"][-4:]
    for key, value in ours["weights"].items():
        assert torch.equal(resumed["weights"][key], value), key


@pytest.mark.parametrize("world", [1, 2])
def test_from_config_built_partitioned_under_zero3(tmp_path, world):
    """LlamaForCausalLM.from_config after TrainingArguments(deepspeed=) with a smartinf block:
    transformers builds it partitioned (deepspeed.zero.Init, never whole), and the run
    equals DeepSpeed's own ZeRO-3 + CPU offload built the same way. (transformers'
    initial weights under zero.Init are not those it draws built whole: both sides here
    build partitioned.)"""
    extra = ("--arch", "llama", "--partitioned")
    ours = run(tmp_path, "ours", "trainer-deepspeed", world=world, extra=extra)
    ref = run(tmp_path, "ref", "trainer-deepspeed", mode="reference", world=world, extra=extra)
    assert ours["partitioned"] and ref["partitioned"]
    for a, b in zip(ours["losses"], ref["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (ours["losses"], ref["losses"])
    # Rare tokens' embeddings get gradients at rounding-noise level in a few dimensions, which
    # Adam scales up to steps of ~lr (as GPT-2's key bias above; here they cannot be named
    # ahead): a few elements may differ, by no more than Adam's steps can move them.
    adam_bound = 2 * len(ref["losses"]) * LR * (1 - 0.9) / (1 - 0.999) ** 0.5
    for key, value in ref["weights"].items():
        off = ~torch.isclose(ours["weights"][key], value, rtol=1e-5, atol=1e-5)
        assert off.sum() <= 1e-3 * value.numel(), (key, int(off.sum()))
        assert torch.all((ours["weights"][key] - value).abs() <= adam_bound), key


def test_a_blocks_auto_is_left_to_smartinf_by_accelerate(tmp_path):
    """Accelerate (under the Trainer) takes every "auto" in a DeepSpeed config for one of its
    own arguments and refused the block's ``"state_dtype": "auto"`` before training began.
    The block's keys are now smartinf's: the run trains, bit for bit as the one with the
    format auto chose spelled out (fp32 states, for a model this small); torch's LR scheduler
    sees the optimizer step (it warned that the schedule's first value was skipped)."""
    extra = ("--arch", "llama", "--partitioned", "--steps", "4")
    auto = run(tmp_path, "auto", "trainer-deepspeed", extra=(*extra, "--state-dtype", "auto"))
    spelled = run(tmp_path, "fp32", "trainer-deepspeed", extra=(*extra, "--state-dtype", "fp32"))
    assert auto["losses"] == spelled["losses"] and len(auto["losses"]) == 4
    assert "lr_scheduler.step()` before `optimizer.step()" not in auto["log"]
    for key, value in spelled["weights"].items():
        assert torch.equal(auto["weights"][key], value), key


def test_accelerate_leaves_the_block_alone_without_smartinf_code():
    """A script that never imports smartinf (the Trainer's own launcher) gets the patch from
    the autoload at interpreter start; SMARTINF_AUTOLOAD=0 turns it off."""
    probe = ("import accelerate.utils.dataclasses as d, sys; "
             "print(hasattr(d.DeepSpeedPlugin.fill_match, '__wrapped__'), 'smartinf' in sys.modules)")
    for autoload, expected in (("1", "True True"), ("0", "False False")):
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              env=dict(os.environ, SMARTINF_AUTOLOAD=autoload), timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip().splitlines()[-1] == expected, (autoload, done.stdout)
