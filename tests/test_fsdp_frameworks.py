"""FSDP2 through the frameworks (issue 61), on the CPU with gloo at world 2: Accelerate's
``prepare()`` and the Hugging Face Trainer make the optimizer over the whole model, shard it,
and put the sharded params into the optimizer's groups; smartinf.optim lays its states out
once the sharded params are there. Against the same framework with torch's AdamW
(tests/fsdp_frameworks.py says how Accelerate is brought onto its FSDP2 path on a CPU)."""
import json
import os
from pathlib import Path

import pytest
import torch

import warm
from conftest import assert_close_fp32, free_port
import fsdp_frameworks

pytest.importorskip("accelerate")
WORLD = 2
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp" / "train.py"


# What the ranks import before their first line (tests/warm.py's zygote has them imported
# once, in place of torch.multiprocessing.spawn's fresh interpreters).
WARM = ("torch", "torch.distributed.fsdp", "torch.distributed.checkpoint", "smartinf.optim",
        "accelerate", "transformers.trainer", "transformers.models.llama.modeling_llama",
        "fsdp_frameworks")
EXAMPLE_WARM = ("torch", "torch.distributed.fsdp", "smartinf.optim", "examples.fsdp.train")


def launch(tmp_path, fn, name, **config):
    config = dict(config, out=str(tmp_path / f"{name}.pt"))
    config.setdefault("dir", str(tmp_path / name))
    port = free_port()
    warm.spawn("fsdp-frameworks", WARM, fn, (WORLD, port, config), WORLD)
    return torch.load(config["out"])


def assert_params_close(ours, theirs):
    assert ours["sharded"] and theirs["sharded"]
    for step, (a, b) in enumerate(zip(ours["params"], theirs["params"]), 1):
        assert len(a) == len(b)
        for i, (p, q) in enumerate(zip(a, b)):
            assert_close_fp32(p.numpy(), q.numpy(), f"param {i} after step {step}")


def test_accelerate_prepare_save_and_load_state(tmp_path):
    """``accelerator.prepare(model, smartinf.optim.AdamW(model.parameters(), ...))`` with FSDP2:
    torch's AdamW's params after every step with ``accelerator.clip_grad_norm_`` acting; then
    ``save_state`` after step 3 and ``load_state`` in a fresh run (new directories) continue
    as the uninterrupted run, bit for bit."""
    ours = launch(tmp_path, fsdp_frameworks.accelerate_run, "ours", optim="smartinf", steps=6)
    theirs = launch(tmp_path, fsdp_frameworks.accelerate_run, "torch", optim="torch", steps=6)
    assert_params_close(ours, theirs)
    assert ours["loss"][-1] < ours["loss"][0]
    assert ours["laid_out"][0] == ours["laid_out"][1] < sum(p.numel() for p in ours["params"][0])
    ckpt = str(tmp_path / "ckpt")
    launch(tmp_path, fsdp_frameworks.accelerate_run, "first", optim="smartinf", steps=3, save=ckpt)
    rest = launch(tmp_path, fsdp_frameworks.accelerate_run, "rest", optim="smartinf", first=3,
                  steps=6, load=ckpt)
    for a, b in zip(rest["params"], ours["params"][3:]):
        for p, q in zip(a, b):
            assert torch.equal(p, q)


def test_a_step_finished_during_the_next_forward_under_accelerate(tmp_path):
    """Accelerate shards the model after the optimizer is made, so the states are laid out
    by the first step, after its forward: the next forwards' all-gathers still wait for
    their own shards' sub-groups (each FSDP2 param group found), and every step's params
    are bit for bit those of the step finished in ``step()``."""
    tail = launch(tmp_path, fsdp_frameworks.accelerate_run, "tail", optim="smartinf", steps=4, tail=True)
    now = launch(tmp_path, fsdp_frameworks.accelerate_run, "now", optim="smartinf", steps=4)
    assert tail["tail"]["deferred"] > 0 and now["tail"] is None
    assert tail["tail"]["groups"] == 2  # (each Linear's: the root holds no param of its own)
    for a, b in zip(tail["params"], now["params"]):
        for p, q in zip(a, b):
            assert torch.equal(p, q)


def test_trainer_trains_checkpoints_and_resumes(tmp_path):
    """The Trainer with ``fsdp="full_shard"``, ``fsdp_config={"fsdp_version": 2}`` and
    ``optimizer_cls_and_kwargs=(smartinf.optim.AdamW, {...})``, no other code: its losses and
    final params as with torch's AdamW (clipping, a linear schedule, two param groups); resumed
    from its step-2 checkpoint in a fresh run, the same final params bit for bit."""
    pytest.importorskip("transformers")
    out = tmp_path / "out"
    ours = launch(tmp_path, fsdp_frameworks.trainer_run, "ours", optim="smartinf", steps=4, save=str(out))
    theirs = launch(tmp_path, fsdp_frameworks.trainer_run, "torch", optim="torch", steps=4,
                    save=str(tmp_path / "torch-out"))
    assert_params_close(ours, theirs)
    assert len(ours["loss"]) == 4
    torch.testing.assert_close(torch.tensor(ours["loss"]), torch.tensor(theirs["loss"]))
    resumed = launch(tmp_path, fsdp_frameworks.trainer_run, "resumed", optim="smartinf", steps=4,
                     save=str(tmp_path / "out2"), load=str(out / "checkpoint-2"))
    for p, q in zip(resumed["params"][0], ours["params"][0]):
        assert torch.equal(p, q)


def test_the_example_trains_as_fsdp2_with_torch_adamw(tmp_path):
    """examples/fsdp/train.py at world 2 (the GPT built on the meta device, sharded, its
    shards initialised): smartinf's losses those of FSDP2 + torch's AdamW on the same
    weights and batches. The first bit for bit (the same shards); then within 1e-5 relative:
    the params agree to the fp32 tolerance (1e-6, tests above), and the loss over a batch
    moves by about as much as they do."""
    losses = {}
    for mode in ("smartinf", "fsdp"):
        out = tmp_path / f"{mode}.json"
        # torchrun --nproc_per_node=WORLD EXAMPLE ..., forked from a warm process (tests/warm.py);
        # in smartinf mode torch.distributed.run itself, as users launch it
        done = warm.run("fsdp-example", EXAMPLE_WARM, [EXAMPLE, "--mode", mode, "--dir", tmp_path / mode,
                                                       "--steps", "5", "--json", out],
                        world=WORLD, env=dict(os.environ), port=free_port(), timeout=600,
                        fresh_=mode == "smartinf")
        assert done.returncode == 0, f"{mode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        losses[mode] = [r["loss"] for r in json.loads(out.read_text())["steps"]]
    assert losses["smartinf"][0] == losses["fsdp"][0]
    torch.testing.assert_close(losses["smartinf"], losses["fsdp"], rtol=1e-5, atol=0)
    assert losses["smartinf"][-1] < losses["smartinf"][0]
