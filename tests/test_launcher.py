"""Runs that end as users' scripts end, under the real launcher (``torch.distributed.run``, each
rank a fresh interpreter), exit 0 every time: an FSDP2 script and a DeepSpeed one with the
smartinf block that end without closing the optimizer or destroying the process group, and
the FSDP2 example. Before ``step.ranks.leave_cleanly`` about one such FSDP2 run in three
aborted at exit (gloo's worker thread dropping a finished collective's tensors while the
interpreter finalized). ``SMARTINF_LAUNCHES`` runs of each (2; 20 measured the fix)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
LAUNCHES = int(os.environ.get("SMARTINF_LAUNCHES", "2"))

FSDP2 = """
import sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import smartinf.optim
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
opt = smartinf.optim.AdamW(model.parameters(), lr=1e-3, devices=[sys.argv[1]], max_grad_norm=1.0)
for step in range(3):
    loss = model(torch.randn(4, 32)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    dist.all_reduce(loss.detach())
print("done", dist.get_rank())
"""

DEEPSPEED = """
import sys, torch, deepspeed
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
          "zero_optimization": {"stage": 3}, "steps_per_print": 10 ** 9,
          "smartinf": {"devices": [sys.argv[1]]}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
for step in range(3):
    loss = engine(torch.randn(4, 32)).pow(2).mean()
    engine.backward(loss)
    engine.step()
print("done", torch.distributed.get_rank())
"""


def launch(tmp_path, argv: list, name: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"
    for i in range(LAUNCHES):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                               "--master_port", str(free_port()), *argv, str(tmp_path / f"{name}-{i}")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"launch {i + 1} of {LAUNCHES}: rc {done.returncode}\n" \
                                     f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


@pytest.mark.parametrize("script", ["fsdp2", "deepspeed"])
def test_a_script_that_ends_without_cleaning_up_exits_0(tmp_path, script):
    path = tmp_path / f"user_{script}.py"  # (not deepspeed.py: it would import itself)
    path.write_text(FSDP2 if script == "fsdp2" else DEEPSPEED)
    launch(tmp_path, [str(path)], script)


def test_the_fsdp2_example_exits_0(tmp_path):
    launch(tmp_path, ["examples/fsdp/train.py", "--steps", "2", "--dir"], "example")
