"""What a script that never calls ``close()`` keeps when it ends (smartinf/pipeline/at_exit.py):
its steps made durable at interpreter exit, whatever keeps the optimizer alive past
finalization (issue 88: a ``logging.Handler`` subclass, tqdm's recipe, had left the directory
at step 0), also where an exception escapes the script; a failure there is said."""
import subprocess
import sys
import textwrap

import pytest
import torch

import smartinf.optim as so
from conftest import assert_close_fp32
from smartinf.pipeline.checkpoint import manifest_fields

SCRIPT = textwrap.dedent("""
    import logging, sys
    import torch
    import smartinf.optim as so

    class Handler(logging.Handler):  # (defined at module level: what kept the optimizer alive)
        def emit(self, record):
            pass

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = so.AdamW(model.parameters(), lr=1e-2, devices=[sys.argv[1]], commit_every=10)
    logging.getLogger().addHandler(Handler())
    for step in range(3):
        torch.manual_seed(100 + step)
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    {end}
""")


#: the commit at exit fails; the error said on stderr (the script's handler swallows records)
FAIL_AT_EXIT = ("import smartinf._native as n; n.arm_fault('manifest.written', 'error')\n"
                "logging.getLogger().addHandler(logging.StreamHandler())")


def torch_reference(steps: int) -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        torch.manual_seed(100 + step)
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def run(directory: str, end: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(end=end), directory],
                          capture_output=True, text=True, timeout=120)


def assert_reopens_at_torchs_step(directory: str, steps: int) -> None:
    expected, ref = torch_reference(steps)
    model = torch.nn.Linear(16, 8)
    opt = so.AdamW(model.parameters(), lr=1e-2, devices=[directory], if_exists="resume")
    assert opt.pipeline.durable_step_count == steps
    for (name, p), q in zip(model.named_parameters(), expected.parameters()):
        assert_close_fp32(p.detach().numpy(), q.detach().numpy(), name)
        state, torch_state = opt.state[p], ref.state[q]
        assert int(state["step"]) == steps
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close_fp32(state[key].numpy(), torch_state[key].numpy(), f"{name} {key}")
    opt.close()


@pytest.mark.parametrize("end, code", [("", 0), ("raise RuntimeError('the script failed')", 1)])
def test_a_script_that_never_closes_keeps_its_steps(tmp_path, end, code):
    """Three steps, ``commit_every=10``, no ``close()``: the directory reopens at step 3 with
    torch's values, at a normal end and where an exception escapes (the completed steps are
    good ones)."""
    done = run(str(tmp_path), end)
    assert done.returncode == code, done.stderr
    assert ("RuntimeError: the script failed" in done.stderr) == bool(end)
    assert_reopens_at_torchs_step(str(tmp_path), 3)


def test_a_failure_at_exit_says_where_the_directory_stays(tmp_path):
    """The commit at exit fails (the manifest cannot be written): said at error level, naming
    the directory and the step it stays at; the exit goes on (with the script's own status)."""
    done = run(str(tmp_path), FAIL_AT_EXIT)
    assert done.returncode == 0, done.stderr
    assert f"smartinf: at exit, the steps of {tmp_path} could not be made durable" in done.stderr
    assert "the directories stay at step 0, their last durable commit" in done.stderr
    assert manifest_fields(str(tmp_path))["step"] == "0"


def test_a_forked_child_closes_nothing(tmp_path):
    """A child forked from the process that opened the pipeline exits through ``atexit`` too:
    it must not write the parent's directory (the parent's steps are its own to commit)."""
    done = run(str(tmp_path), "import os\nif os.fork() == 0: sys.exit(0)\nos.wait()\n" + FAIL_AT_EXIT)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("could not be made durable") == 1  # the parent's, not the child's
    assert manifest_fields(str(tmp_path))["step"] == "0"  # (the child had committed step 3)
