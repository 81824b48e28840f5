"""One rank of an FSDP2 run through Accelerate or the Hugging Face Trainer (gloo, on the CPU)
for tests/test_fsdp_frameworks.py: the optimizer named as users name it, made before the
framework shards the model, then trained, checkpointed and resumed by the framework.

    spawn(accelerate_run or trainer_run, args=(world, port, config), nprocs=world)

Accelerate takes its FSDP2 path on GPUs only: on the CPU it drops the plugin and wraps the
model in DDP. ``forced`` sets the distributed type its GPU path sets (what the research for
issue 61 found), so the real ``_prepare_fsdp2`` runs here: ``fully_shard`` per module, then
the sharded params written into the optimizer's groups.

``config``: ``optim`` ("smartinf" or "torch"), ``dir`` (smartinf's devices), ``out`` (rank 0's
record), ``steps``, ``tail`` (Accelerate: SMARTINF_STEP_TAIL_ON_CPU=1, the step finished while
the next forward runs), ``save`` / ``load`` (a checkpoint directory the framework writes after the
last step / reads before the first; the Trainer: ``output_dir`` and the checkpoint resumed).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import smartinf.optim as so
from fsdp_train import BATCH, LR, WEIGHT_DECAY, model as sharded_model

CLIP = 0.05


def forced(accelerator, **plugin_args) -> None:
    """Accelerate's state as on GPUs with an FSDP2 plugin (see the module)."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    plugin = FullyShardedDataParallelPlugin(**plugin_args)
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # re-read from there
    accelerator.state.fsdp_plugin = plugin


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), SMARTINF_SPECULATE_ON_CPU="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)


def accelerate_run(rank: int, world: int, port: int, config: dict) -> None:
    from accelerate import Accelerator
    _init(rank, world, port)
    if config.get("tail"):
        os.environ["SMARTINF_STEP_TAIL_ON_CPU"] = "1"
    accelerator = Accelerator(cpu=True)
    forced(accelerator, fsdp_version=2, auto_wrap_policy="size_based_wrap", min_num_params=1)
    m = sharded_model(dict(unsharded=True))
    opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WEIGHT_DECAY) \
        if config["optim"] == "torch" else \
        so.AdamW(m.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, devices=[config["dir"]],
                 subgroup_size=300, chunk=128)
    m, opt = accelerator.prepare(m, opt)
    if config.get("load"):
        accelerator.load_state(config["load"])
    record = {"loss": [], "params": []}
    for step in range(config.get("first", 0), config["steps"]):
        rows = BATCH // world
        x = torch.randn(BATCH, 24, generator=torch.Generator().manual_seed(100 + step))
        loss = m(x[rows * rank:rows * (rank + 1)]).pow(2).mean()
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(m.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        record["loss"].append(float(accelerator.reduce(loss.detach(), "mean")))
        record["params"].append([p.full_tensor().detach().clone() for p in m.parameters()])
    if config.get("save"):
        accelerator.save_state(config["save"])
    record["sharded"] = all(type(p).__name__ == "DTensor" for p in m.parameters())
    if config["optim"] == "smartinf":  # laid out over this rank's shards, not the whole model
        record["laid_out"] = (sum(sg.numel for sg in opt.optimizer._plan),
                              sum(p.to_local().numel() for p in m.parameters()))
        tail = opt.optimizer._tail  # (its FSDP2 param groups whose all-gathers wait for it)
        record["tail"] = tail and {"deferred": tail.deferred, "groups": len(tail._unsharded)}
    if rank == 0:
        torch.save(record, config["out"])
    dist.destroy_process_group()


def trainer_run(rank: int, world: int, port: int, config: dict) -> None:
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    transformers.logging.set_verbosity_error()
    _init(rank, world, port)

    class FSDP2Trainer(Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            forced(self.accelerator, **self.args.fsdp_plugin_args)
            self.is_fsdp_enabled = True

    torch.manual_seed(0)
    # (Llama: no biases. GPT-2's key bias has a gradient of rounding noise only, whose Adam
    # update is the noise's sign: no two runs agree on it, torch's with itself neither.)
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2,
                                         vocab_size=64, max_position_embeddings=16))
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (32, 16), generator=g)]
    args = TrainingArguments(output_dir=config["save"], use_cpu=True, max_steps=config["steps"],
                             per_device_train_batch_size=4 // world, learning_rate=LR,
                             weight_decay=WEIGHT_DECAY, max_grad_norm=CLIP, lr_scheduler_type="linear",
                             warmup_steps=1, save_strategy="steps", save_steps=2, report_to=[],
                             logging_steps=1, seed=0, fsdp="full_shard",
                             fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    cls, kw = (torch.optim.AdamW, {}) if config["optim"] == "torch" else \
        (so.AdamW, dict(devices=[config["dir"]], subgroup_size=2000, chunk=512))
    trainer = FSDP2Trainer(model=llama, args=args, train_dataset=data,
                           optimizer_cls_and_kwargs=(cls, dict(kw, lr=LR, weight_decay=WEIGHT_DECAY)))
    trainer.train(resume_from_checkpoint=config.get("load"))
    record = {"loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              "params": [[p.full_tensor().detach().clone() for p in trainer.model.parameters()]],
              "sharded": all(type(p).__name__ == "DTensor" for p in trainer.model.parameters())}
    if rank == 0:
        torch.save(record, config["out"])
    dist.destroy_process_group()
