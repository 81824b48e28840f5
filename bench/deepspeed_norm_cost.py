"""What step()'s gradient norms by sub-group cost: smartinf's ``norm_groups`` (one all-reduce
and one inf/NaN check for every sub-group: ``smartinf/integrations/deepspeed_norm.py``)
against DeepSpeed's own ``_get_norm_groups`` (each sub-group on its own), on the same
gradients, alternated, in one process: the GPT example's model under ZeRO-3 with the smartinf
block and many sub-groups. Seconds until the combined norm is on the host (as step() needs
it), medians of ``--rounds``; both must give the same bits.

    python bench/deepspeed_norm_cost.py [--model gpt2-small] [--sub-group-size 2000000]
        [--rounds 20] [--json F]          (DS_ACCELERATOR=cpu without a GPU)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29561", "RANK": "0", "LOCAL_RANK": "0",
             "WORLD_SIZE": "1"}.items():
    os.environ.setdefault(k, v)

import deepspeed  # noqa: E402
from deepspeed.runtime.utils import combine_grad_norm_groups  # noqa: E402

import smartinf.integrations.deepspeed as smartinf_ds  # noqa: E402
from smartinf.integrations.deepspeed_norm import norm_groups  # noqa: E402
from examples.gpt.data import Language, batches  # noqa: E402
from examples.gpt.model import GPT, MODELS, GPTConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--sub-group-size", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--json")
    a = p.parse_args()
    deepspeed.init_distributed()
    lang = Language()
    d, n_layer, n_head, vocab = MODELS[a.model]
    model = GPT(GPTConfig(vocab or lang.vocab_size, 64, d, n_layer, n_head), seed=0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "sub_group_size": a.sub_group_size},
              "steps_per_print": 10 ** 9,
              "smartinf": {"devices": [tempfile.mkdtemp(prefix="norm-cost-")]}}
    eng = smartinf_ds.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
    x, y = (t.to(eng.device) for t in next(batches(lang, 2, 64, seed=1)))
    logits = eng(x)
    eng.backward(F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1)))
    opt = eng.optimizer
    ways = {"smartinf norm_groups": lambda: norm_groups(opt),
            "DeepSpeed _get_norm_groups": opt._get_norm_groups}
    times: dict = {k: [] for k in ways}
    values: dict = {}
    for _ in range(a.rounds):
        for name, way in ways.items():
            start = time.perf_counter()
            values[name] = float(combine_grad_norm_groups(way()))  # (on the host: a sync)
            times[name].append(time.perf_counter() - start)
    ours, theirs = (statistics.median(times[k]) for k in ways)
    result = {"model": a.model, "sub_groups": len(opt.fp16_groups), "device": str(eng.device),
              "seconds": {k: statistics.median(v) for k, v in times.items()},
              "ratio": ours / theirs, "same_value": len(set(values.values())) == 1}
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    eng.destroy()


if __name__ == "__main__":
    main()
