"""A small GPT-2 (built from a config: no downloads) trained the Hugging Face way, with the
optimizer states on smartinf devices and no smartinf code beyond the import.

    torchrun --nproc_per_node=2 examples/huggingface/train.py --via trainer-deepspeed --dir /nvme/run
    python examples/huggingface/train.py --via trainer-optimizers --dir /nvme/run
    python examples/huggingface/train.py --via accelerate --dir /nvme/run
    torchrun --nproc_per_node=1 examples/huggingface/train.py --arch llama --size 13b --partitioned \
        --bf16 --batch 8 --seq 1024 --gradient-checkpointing --state-dtype auto --save-every 0 \
        --steps 10 --dir /nvme/run --out 13b.json

``--via``:
  * ``trainer-deepspeed``: ``TrainingArguments(deepspeed=config)`` with a ZeRO-3 config holding
    a ``"smartinf"`` block (``--mode reference``: the same config with DeepSpeed's CPU
    optimizer offload instead);
  * ``trainer-optimizers``: ``Trainer(optimizers=(smartinf.optim.AdamW(...), None))``
    (reference: ``torch.optim.AdamW``);
  * ``accelerate``: ``accelerator.prepare`` and ``save_state`` / ``load_state``.
Checkpoints are saved every ``--save-every`` steps; ``--resume-from CKPT`` resumes from one.
The Trainer's (or Accelerate's) checkpoints are the source of truth, so the devices use
``if_exists="overwrite"``: a run starts from the model's weights, or from the checkpoint it
resumes. ``--out`` writes the per-step losses and the final fp32 weights (for DeepSpeed
consolidated from the checkpoint with ``get_fp32_state_dict_from_zero_checkpoint``).
Without a GPU set ``DS_ACCELERATOR=cpu`` for DeepSpeed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `examples.gpt` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import transformers  # noqa: E402

import smartinf.optim  # noqa: E402,F401  (the only smartinf line a DeepSpeed user needs)
from examples.gpt.data import Language, batches  # noqa: E402

SEQ, BATCH, LR, WEIGHT_DECAY = 32, 4, 3e-3, 0.1
LLAMA_SIZES = {  # name: (hidden, intermediate, layers, heads, vocabulary or None for the data's)
    "tiny": (64, 172, 2, 4, None),
    "7b": (4096, 11008, 32, 32, 32000),   # Llama-2 7B's shape, 6.7 B params
    "13b": (5120, 13824, 40, 40, 32000),  # Llama-2 13B's, 13.0 B params
}


def model(arch: str = "gpt2", size: str = "tiny", seq: int = SEQ) -> transformers.PreTrainedModel:
    """GPT-2's layout (tiny), or Llama's (``AutoModelForCausalLM.from_config``, which a ZeRO-3
    DeepSpeed config given to the Trainer first builds partitioned: ``deepspeed.zero.Init``,
    never whole in memory)."""
    torch.manual_seed(0)
    if arch == "llama":
        hidden, intermediate, layers, heads, vocab = LLAMA_SIZES[size]
        config = transformers.LlamaConfig(vocab_size=vocab or len(Language().vocab),
                                          hidden_size=hidden, intermediate_size=intermediate,
                                          num_hidden_layers=layers, num_attention_heads=heads,
                                          max_position_embeddings=seq)
        return transformers.AutoModelForCausalLM.from_config(config)
    config = transformers.GPT2Config(vocab_size=len(Language().vocab), n_positions=SEQ, n_embd=64,
                                     n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


class Text(torch.utils.data.Dataset):
    """Rows of the generated language, the same in every run."""

    def __init__(self, rows: int, seq: int = SEQ) -> None:
        stream = batches(Language(), rows, seq, seed=1)
        self.inputs = next(stream)[0]

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.inputs[i], "labels": self.inputs[i]}


def deepspeed_config(args: argparse.Namespace) -> dict:
    zero: dict = {"stage": 3}
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto",
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                        "betas": "auto", "eps": "auto"}},
              "zero_optimization": zero}
    if args.bf16:
        config["bf16"] = {"enabled": "auto"}
    if args.mode == "smartinf":
        config["smartinf"] = {"devices": [args.dir], "if_exists": "overwrite"}
        if args.state_dtype:
            config["smartinf"]["state_dtype"] = args.state_dtype
        if args.gpu_memory_budget:
            config["smartinf"]["gpu"] = {"memory_budget": args.gpu_memory_budget}
        if args.gpu_host_states != "auto":
            config["smartinf"].setdefault("gpu", {})["host_states"] = \
                {"on": True, "off": False}.get(args.gpu_host_states, args.gpu_host_states)
    else:
        zero["offload_optimizer"] = {"device": "cpu"}
    return config


def make_optimizer(args: argparse.Namespace, net: torch.nn.Module) -> torch.optim.Optimizer:
    if args.mode == "smartinf":
        return smartinf.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                    devices=[args.dir], if_exists="overwrite")
    return torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def training_args(args: argparse.Namespace, **extra) -> transformers.TrainingArguments:
    saves = {"save_strategy": "steps", "save_steps": args.save_every} if args.save_every else \
        {"save_strategy": "no"}
    return transformers.TrainingArguments(
        output_dir=args.checkpoints, max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=args.lr, weight_decay=WEIGHT_DECAY, max_grad_norm=1.0,
        lr_scheduler_type="constant_with_warmup" if args.warmup_steps else "constant",
        warmup_steps=args.warmup_steps,
        logging_steps=1, report_to=[], bf16=args.bf16,
        gradient_checkpointing=args.gradient_checkpointing,
        use_cpu=not torch.cuda.is_available(), seed=0, data_seed=0, **saves, **extra)


BUILT = {}  # how the model was built: partitioned (ZeRO-3's zero.Init) or whole


class StepTimes(transformers.TrainerCallback):
    """Seconds of each optimizer step's iteration (forward, backward and step), end to end."""

    def __init__(self) -> None:
        self.ends: list = []

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.ends:
            self.ends.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())
        if state.is_world_process_zero:
            print(f"step {state.global_step} {self.ends[-1] - self.ends[-2]:.3f} s", flush=True)

    def seconds(self) -> list:
        return [b - a for a, b in zip(self.ends, self.ends[1:])]


TIMES = StepTimes()


def with_trainer(args: argparse.Namespace) -> tuple[list, dict]:
    extra, optimizers = {}, (None, None)
    if args.via == "trainer-deepspeed":
        extra["deepspeed"] = deepspeed_config(args)
    if args.partitioned:  # built after the ZeRO-3 config is known: partitioned as made
        training = training_args(args, **extra)
        net = model(args.arch, args.size, args.seq)
    else:
        net = model(args.arch, args.size, args.seq)
        training = training_args(args, **extra)
    BUILT["partitioned"] = all(hasattr(q, "ds_id") for q in net.parameters())
    if args.via != "trainer-deepspeed":
        optimizers = (make_optimizer(args, net), None)
    trainer = transformers.Trainer(model=net, args=training, callbacks=[TIMES],
                                   train_dataset=Text(args.batch * args.steps * 2, args.seq),
                                   optimizers=optimizers)
    trainer.train(resume_from_checkpoint=args.resume_from)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    if not args.save_every:
        return losses, {}
    if args.via == "trainer-deepspeed":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        last = os.path.join(args.checkpoints, f"checkpoint-{args.steps}")
        weights = get_fp32_state_dict_from_zero_checkpoint(last)  # consolidated fp32 masters
    else:
        weights = {k: v.detach().float().clone() for k, v in net.state_dict().items()}
    return losses, weights


def with_accelerate(args: argparse.Namespace) -> tuple[list, dict]:
    import accelerate
    accelerator = accelerate.Accelerator(cpu=not torch.cuda.is_available())
    net = model()
    net, optimizer = accelerator.prepare(net, make_optimizer(args, net))
    data = Text(BATCH * args.steps)
    first = 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        first = int(Path(args.resume_from).name.split("-")[-1])
    losses = []
    for step in range(first, args.steps):
        rows = data.inputs[step * BATCH:(step + 1) * BATCH].to(accelerator.device)
        loss = net(input_ids=rows, labels=rows).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        if (step + 1) % args.save_every == 0:
            accelerator.save_state(os.path.join(args.checkpoints, f"checkpoint-{step + 1}"))
    return losses, {k: v.detach().float().clone() for k, v in net.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--via", choices=("trainer-deepspeed", "trainer-optimizers", "accelerate"),
                        default="trainer-deepspeed")
    parser.add_argument("--mode", choices=("smartinf", "reference"), default="smartinf")
    parser.add_argument("--dir", required=True, help="states directory (smartinf devices)")
    parser.add_argument("--checkpoints", help="checkpoint directory (default: DIR/checkpoints)")
    parser.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2",
                        help="llama: AutoModelForCausalLM.from_config of a Llama config")
    parser.add_argument("--size", choices=sorted(LLAMA_SIZES), default="tiny",
                        help="llama: the model's shape (7b, 13b: Llama-2's)")
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--batch", type=int, default=BATCH, help="rows per GPU (or process)")
    parser.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True)")
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up of the lr")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--state-dtype", choices=("fp32", "int8", "int4", "auto"),
                        help="trainer-deepspeed, smartinf: the block's state_dtype (auto: the "
                             "format, master, memory and copies that fit the box)")
    parser.add_argument("--gpu-memory-budget",
                        help="smartinf: bytes of the GPU's memory for states updated there "
                             "(e.g. 20GB), or auto: what the model and activations leave")
    parser.add_argument("--gpu-host-states", default="auto",
                        type=lambda v: v if v in ("auto", "on", "off") else float(v),
                        help="smartinf: the states kept in host memory updated on the GPU, "
                             "crossing PCIe: on, off, auto (with a GPU budget: where faster), "
                             "or a share from 0 to 1 (that share on the GPU, the rest on the "
                             "host's cores, at once)")
    parser.add_argument("--partitioned", action="store_true",
                        help="trainer-deepspeed, llama: build the model after "
                             "TrainingArguments(deepspeed=), so that from_config builds it "
                             "partitioned under ZeRO-3 (deepspeed.zero.Init)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=4,
                        help="checkpoint every N steps (0: none, and no weights exported)")
    parser.add_argument("--resume-from", help="a checkpoint directory to resume from")
    parser.add_argument("--out", help="JSON of the per-step losses; weights beside it (.pt)")
    args = parser.parse_args()
    args.checkpoints = args.checkpoints or os.path.join(args.dir, "checkpoints")
    run = with_accelerate if args.via == "accelerate" else with_trainer
    losses, weights = run(args)
    rank = int(os.environ.get("RANK", "0"))
    print("losses", " ".join(f"{x:.6f}" for x in losses))
    print("step_s", " ".join(f"{x:.3f}" for x in TIMES.seconds()), flush=True)
    if args.out and rank == 0:
        Path(args.out).write_text(json.dumps({"losses": losses, "step_s": TIMES.seconds(),
                                              "argv": sys.argv[1:], **BUILT}))
        if weights:
            torch.save(weights, Path(args.out).with_suffix(".pt"))


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # see examples/deepspeed/train.py: DeepSpeed's CPU
        torch.distributed.destroy_process_group()  # ops may abort in their static destructors
        sys.stdout.flush()
        os._exit(0)
