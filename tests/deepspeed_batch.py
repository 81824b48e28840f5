"""Several runs of examples/deepspeed/train.py in one torchrun launch (tests/test_deepspeed.py).

A launch pays seconds before its first step (the interpreter, torch, DeepSpeed and its JIT
ops, the process group) for a run of the tiny model that takes about one: the tests' runs
that need nothing done between them go through one launch per world size. Each run is the
example's own ``main()`` with its own argv and environment, one after another in one
process group; every rank's output (fd 1 and 2, the C++ side's included) goes to
``NAME.rank{R}.log`` beside the run's ``--json``, and rank 0 writes ``NAME.done`` ("ok") once
every rank finished it. The first run that raises ends the launch (a rank left waiting in a
collective would hang): its traceback is in its ``.done``, later runs have none.

    torchrun --nproc_per_node=W tests/deepspeed_batch.py RUNS.json
RUNS.json: [{"name": ..., "out": DIR, "args": [...], "env": {...}}, ...]
"""
import gc
import json
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from examples.deepspeed import train  # noqa: E402


def run_one(run: dict, rank: int) -> None:
    out = Path(run["out"])
    saved_env = {k: os.environ.get(k) for k in run["env"]}
    os.environ.update(run["env"])
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    with open(out / f"{run['name']}.rank{rank}.log", "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            sys.argv = [str(ROOT / "examples" / "deepspeed" / "train.py"), *run["args"]]
            train.main()
        except BaseException:
            traceback.print_exc()
            (out / f"{run['name']}.done").write_text(f"rank {rank}:\n{traceback.format_exc()}")
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    gc.collect()  # (the engine's pipelines are closed by destroy(); the rest goes now)
    torch.distributed.barrier()
    if rank == 0:
        (out / f"{run['name']}.done").write_text("ok")


def main() -> None:
    runs = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ["RANK"])
    try:
        for run in runs:
            run_one(run, rank)
    except BaseException:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    train.leave_without_teardown()


if __name__ == "__main__":
    main()
