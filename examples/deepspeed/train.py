"""Trains the compact GPT with DeepSpeed ZeRO-3, the optimizer step on smartinf devices.

    torchrun --nproc_per_node=2 examples/deepspeed/train.py --dir /nvme/run [--steps 20]
    python examples/deepspeed/train.py --mode zero-infinity --dir /nvme/run   (the baseline)

``--mode smartinf`` (the default) is the integration: one ``"smartinf"`` block in the
DeepSpeed config and ``smartinf.integrations.deepspeed.initialize`` in place of
``deepspeed.initialize``. The other modes run DeepSpeed alone on the same model and data:
``deepspeed-cpu`` (ZeRO-3, optimizer offloaded to CPU, DeepSpeedCPUAdam: ZeRO-Offload),
``super-offload`` (the same with DeepSpeed's SuperOffload, CUDA only: CPU Adam per
sub-group during backward, speculative), ``zero-infinity`` (ZeRO-3, optimizer states swapped
to NVMe: ZeRO-Infinity) and ``zenflow`` (ZeRO-Offload at stage 2 with DeepSpeed's ZenFlow: the
most important gradients' updates on the GPU, the rest on the CPU every few steps; not exact
by design). Each rank
reads its own batches; every mode sees the same ones. Per step the script prints the
loss (mean over ranks), the forward / backward / optimizer-step seconds and the bytes
this process read from and wrote to storage during the step; ``--json`` writes them, with
every rank's bytes summed (``host_storage_read``, ``host_storage_written``: the host's disk).
Without a GPU, run with ``DS_ACCELERATOR=cpu`` (gloo; fp32 or bf16).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make `examples.gpt` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.utils import safe_get_full_grad, safe_set_full_grad  # noqa: E402

import smartinf.integrations.deepspeed as smartinf_ds  # noqa: E402
import smartinf.planning.model  # noqa: E402
from examples.gpt import gpu  # noqa: E402
from examples.gpt.counters import counters as pipeline_counters, difference  # noqa: E402
from examples.gpt.data import Language, made_ahead  # noqa: E402
from examples.gpt.model import GPT, MODELS, GPTConfig  # noqa: E402
from examples.gpt.gil_watch import GilWatch  # noqa: E402
from examples.gpt.profiled import Profiled  # noqa: E402

MODES = ("smartinf", "deepspeed-cpu", "super-offload", "zero-infinity", "zenflow")

#: ZenFlow's settings as its tutorial gives them (https://www.deepspeed.ai/tutorials/zenflow):
#: the top 5 % of gradients by importance updated on the GPU each step, the rest accumulated
#: and applied by the CPU's Adam every 4 steps, overlapped with the next steps
ZENFLOW = {"topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto",
           "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": True}


def ds_config(args: argparse.Namespace, world: int) -> dict:
    """The DeepSpeed config of a mode: identical but for where the optimizer runs."""
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.1,
                                                  "betas": [0.9, 0.95], "eps": 1e-8}}
        if args.optimizer == "adamw" else
        {"type": "Lion", "params": {"lr": args.lr / 10, "weight_decay": 0.1, "betas": [0.9, 0.99]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                     "warmup_num_steps": args.warmup}},
        "zero_optimization": {"stage": 3, "sub_group_size": args.sub_group_size},
        "steps_per_print": 10 ** 9,
    }
    if args.offload_param:  # the params in host memory, gathered to the GPU layer by layer
        config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    if args.persistence_threshold is not None:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = \
            args.persistence_threshold
    if args.dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": args.initial_scale_power,
                          "loss_scale_window": args.loss_scale_window}
    elif args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    storage = os.path.join(args.dir, args.mode)
    if args.mode == "smartinf":
        config["smartinf"] = {"devices": [storage], "if_exists": args.if_exists}
        if args.topk:
            config["smartinf"]["compress"] = {"ratio": args.topk}
        if args.state_dtype != "fp32":
            config["smartinf"]["state_dtype"] = args.state_dtype
        if args.split_master:
            config["smartinf"]["master"] = "split"
        for key in ("memory_budget", "commit_every", "compute_threads", "copies"):
            if getattr(args, key) is not None:
                config["smartinf"][key] = getattr(args, key)
        if args.no_overlap:
            config["smartinf"]["overlap"] = False
        if args.gpu_memory_budget:
            config["smartinf"]["gpu"] = {"memory_budget": args.gpu_memory_budget}
            if args.gpu_twins != "auto":
                config["smartinf"]["gpu"]["twins"] = {"on": True, "off": False}.get(args.gpu_twins, "host")
        if args.gpu_host_states != "auto":
            config["smartinf"].setdefault("gpu", {})["host_states"] = \
                {"on": True, "off": False}.get(args.gpu_host_states, args.gpu_host_states)
    elif args.mode == "deepspeed-cpu":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if args.offload_ratio is not None:
            config["zero_optimization"]["offload_optimizer"]["ratio"] = args.offload_ratio
    elif args.mode == "super-offload":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "super_offload": True}
    elif args.mode == "zenflow":  # ZeRO-Offload at stage 2 (ZenFlow's), params whole on the GPU
        config["zero_optimization"] = {"stage": 2, "zenflow": dict(ZENFLOW),
                                       "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    else:
        config["zero_optimization"]["offload_optimizer"] = {
            "device": "nvme", "nvme_path": storage, "pin_memory": True, "buffer_count": 4}
        config["aio"] = {"block_size": 1 << 20, "queue_depth": 32, "thread_count": 1,
                         "single_submit": False, "overlap_events": True}
    return config


def storage_bytes() -> tuple[int, int]:
    """(read, written) bytes this process moved to and from storage so far (all threads)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="smartinf")
    p.add_argument("--dir", required=True, help="storage directory (states / swap files)")
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optimizer", choices=("adamw", "lion"), default="adamw",
                   help="the config's optimizer block (Lion at lr / 10, as the paper advises)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--topk", type=float, default=0.0, help="SmartComp top-k ratio (smartinf)")
    p.add_argument("--state-dtype", choices=["fp32", "int8", "int4", "auto"], default="fp32",
                   help="smartinf: Adam moments in fp32, 8-bit or 4-bit block-wise; auto: the "
                        "format, master, memory budget and commit interval smartinf.planning.plan picks")
    p.add_argument("--split-master", action="store_true",
                   help="smartinf, bf16: store only the low halves of the fp32 masters "
                        "(master=\"split\"); else fp32 masters")
    p.add_argument("--memory-budget", help="smartinf: bytes of states kept resident in RAM "
                   "per device (e.g. 24GiB)")
    p.add_argument("--gpu-memory-budget", help="smartinf: bytes of the GPU's memory for states "
                   "updated there (the \"gpu\" block), or auto: what the model, DeepSpeed's "
                   "gradients and the activations leave")
    p.add_argument("--gpu-host-states", default="auto",
                   type=lambda v: v if v in ("auto", "on", "off") else float(v),
                   help="smartinf: the states kept in host memory (the memory budget) updated "
                        "on the GPU, crossing PCIe: on, off, auto (with a GPU budget: where "
                        "faster), or a share from 0 to 1 (that share on the GPU, the rest on "
                        "the host's cores, at once)")
    p.add_argument("--gpu-twins", choices=("auto", "on", "off", "host"), default="auto",
                   help="smartinf: the GPU's sub-groups with room for their twin, or a host "
                        "copy of its budget that durable commits write from (auto: a host "
                        "copy where host memory holds it, else the model chooses)")
    p.add_argument("--offload-ratio", type=float, help="deepspeed-cpu: the share of the optimizer "
                   "states offloaded to the CPU, the rest updated on the GPU (ZeRO-Offload++)")
    p.add_argument("--commit-every", type=int, help="smartinf: steps per durable commit")
    p.add_argument("--compute-threads", type=int, help="smartinf: threads of the update")
    p.add_argument("--copies", type=lambda v: v if v == "log" else int(v), choices=(1, 2, "log"),
                   help="smartinf: copies of the states on disk (1: half the disk, every state "
                        "resident, a crash during a durable commit loses them; log: one copy "
                        "and each step's gradients, every instant recoverable, with --no-overlap)")
    p.add_argument("--no-overlap", action="store_true",
                   help="smartinf: overlap=False (updates wait for step(); durable commits are "
                        "written before commit() returns)")
    p.add_argument("--sub-group-size", type=int, default=100_000_000)
    p.add_argument("--offload-param", action="store_true",
                   help="ZeRO-3's offload_param to the CPU: the bf16/fp32 params in host memory "
                        "(a model whose params and gradients do not fit the GPUs)")
    p.add_argument("--persistence-threshold", type=int,
                   help="params of at most this many elements stay gathered (DeepSpeed's "
                        "stage3_param_persistence_threshold; its default when not given)")
    p.add_argument("--initial-scale-power", type=int, default=16, help="fp16 loss scaling")
    p.add_argument("--loss-scale-window", type=int, default=1000, help="fp16 loss scaling")
    p.add_argument("--nan-at", type=int, default=0,
                   help="make this step's gradients NaN (the step must be skipped)")
    p.add_argument("--halve-grads-at", type=int, default=0,
                   help="halve this step's gradients between backward and step, as a user "
                        "would through DeepSpeed's safe_get_full_grad / safe_set_full_grad")
    p.add_argument("--save", help="checkpoint directory: save after --save-at steps")
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--load", help="checkpoint directory to resume from")
    p.add_argument("--if-exists", choices=("error", "resume", "overwrite"), default="error",
                   help="smartinf: directories holding an earlier run are refused, resumed, or "
                        "overwritten (with --load: the checkpoint replaces them anyway)")
    p.add_argument("--zero-init", action="store_true",
                   help="build the model partitioned (deepspeed.zero.Init), never whole in "
                        "memory: how ZeRO-3 users build large models; the same weights")
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each block's activations in backward instead of keeping "
                        "them (a larger batch fits the GPU)")
    p.add_argument("--gpu-memory", help="emulate a GPU with this much memory (e.g. 80GiB) on a "
                   "larger one: the rest is held by a tensor made first, so that a GPU budget of "
                   "\"auto\" places the states as it would there")
    p.add_argument("--json", help="write the per-step record here (rank 0)")
    p.add_argument("--profile-step", type=int, default=0,
                   help="write torch.profiler's tables of this step's engine.step() and the next "
                        "iteration's forward and backward to the --json path's .prof.txt")
    p.add_argument("--params-out", help="save the final params (fp32, gathered) here (rank 0)")
    p.add_argument("--watch-gil", action="store_true",
                   help="record per step the seconds Python stood still "
                        "(examples/gpt/gil_watch.py) and the longest stall's stacks")
    args = p.parse_args()

    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", 0)))  # one GPU per rank
    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = torch.device(get_accelerator().current_device_name())
    held_back = gpu.hold_back(args.gpu_memory, device)  # noqa: F841 (kept until the end)
    d_model, n_layer, n_head, vocab = MODELS[args.model]
    lang = Language()
    config = ds_config(args, world)
    shape = GPTConfig(vocab or lang.vocab_size, args.seq, d_model, n_layer, n_head)
    if args.zero_init and config["zero_optimization"]["stage"] != 3:
        p.error(f"--zero-init builds the model partitioned for ZeRO-3; --mode {args.mode} is stage "
                f"{config['zero_optimization']['stage']}, whose params are whole on each GPU")
    if args.zero_init:  # each param partitioned as it is made, initialised gathered
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = GPT(shape, seed=0, checkpoint=args.checkpoint_activations,
                        whole=lambda q: deepspeed.zero.GatheredParameters([q], modifier_rank=0))
    else:
        model = GPT(shape, seed=0, checkpoint=args.checkpoint_activations)
    init = smartinf_ds.initialize if args.mode == "smartinf" else deepspeed.initialize
    engine, _, _, _ = init(model=model, model_parameters=model.parameters(), config=config)

    start = 0
    if args.load:
        path, client = engine.load_checkpoint(args.load)
        if path is None:
            raise SystemExit(f"no checkpoint found in {args.load}")
        start = client["step"]
    data = made_ahead(lang, args.batch, args.seq, 1000 + rank, args.steps, device)
    for _ in range(start):
        next(data)  # the batches the checkpointed steps consumed

    def the_pipeline():  # (with a GPU budget of "auto", opened by the first step: it sizes it)
        return getattr(engine.optimizer, "pipeline", None)

    def described(pipeline) -> tuple:
        """Each device's I/O schedule and twins, and why; the model's step for this placement,
        from the probe's record of the states' directory (python -m smartinf.probe DIR
        --record): compare with the forward's waits + the step."""
        choices = {"io_schedules": [f"{c.schedule}: {c.reason}" for c in pipeline.io_schedules],
                   "twins": [f"{c.twins}: {c.reason}" for c in pipeline.twins]}
        prediction = smartinf.planning.placement.predict_pipeline(pipeline)
        if rank == 0:
            print(f"smartinf: {choices}", flush=True)
            if prediction:
                print(f"smartinf.planning.model: step {prediction.step_s:.3f} s ({prediction.bound}) for "
                      f"{prediction.placement}", flush=True)
        return choices, prediction and dict(dataclasses.asdict(prediction), bound=prediction.bound)

    choices = predicted = None
    if the_pipeline() is not None:
        choices, predicted = described(the_pipeline())

    def counters() -> dict:
        return pipeline_counters(engine.optimizer)

    records = []
    num_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())

    def write_record(after_steps: "dict | None") -> None:
        """The record so far (rank 0), replaced after each step so that a run stopped early
        (a time limit, a kill) leaves its steps; ``after_steps`` (what the last step's
        updates moved once settled) only in a whole run's."""
        if not (args.json and rank == 0):
            return
        partial = Path(f"{args.json}.partial")
        partial.write_text(json.dumps({
            "mode": args.mode, "model": args.model, "num_params": num_params, "world_size": world,
            "dtype": args.dtype, "topk": args.topk, "smartinf": config.get("smartinf"),
            "choices": choices, "predicted": predicted,
            "throughput_timer_synchronized": engine.tput_timer.config.synchronized,
            "steps": records, "after_steps": after_steps}, indent=1))
        os.replace(partial, args.json)
    # Each step's counters run from where the last one's stopped: background writes that
    # land between two steps are counted too.
    c1, io1 = counters(), storage_bytes()
    profiler = None
    watch = GilWatch() if args.watch_gil else None
    t4 = None
    for step in range(start, args.steps):
        t_data = time.perf_counter()
        x, y = next(data)
        c0, io0 = c1, io1
        t0 = time.perf_counter()
        logits = engine(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        if step + 1 == args.nan_at:
            loss = loss * float("nan")
        settle_stream()
        t1 = time.perf_counter()
        engine.backward(loss)
        if step + 1 == args.halve_grads_at:
            for param in engine.module.parameters():  # (a gather each: every rank calls it)
                grad = safe_get_full_grad(param)
                if grad is not None:
                    safe_set_full_grad(param, grad * 0.5)
        settle_stream()
        t2 = time.perf_counter()
        if profiler is not None:  # (the iteration after the profiled step: done)
            profiler.stop(Path(args.json).with_suffix(".prof.txt"))
            profiler = None
        if args.profile_step == step + 1 and rank == 0 and args.json:
            profiler = Profiled(torch.cuda.is_available())
        engine.step()
        settle_stream()
        t3 = time.perf_counter()
        io1 = storage_bytes()
        # where the time between step()'s return and the next forward goes ("between"): from
        # t3 on, and the last step's record written (from its t4) and this one's batch
        between = {"last_record": None if t4 is None else t_data - t4, "data": t0 - t_data}
        mean_loss = loss.detach().float().clone()
        torch.distributed.all_reduce(mean_loss)
        between["loss_all_reduce"] = time.perf_counter() - t3
        # every rank's storage bytes: the host's disk is one, whatever the world size
        host_io = torch.tensor([io1[0] - io0[0], io1[1] - io0[1]], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(host_io)
        loss_value = mean_loss.item()
        between["loss_item"] = time.perf_counter() - t3
        rec = {"step": step + 1, "loss": loss_value / world, "fwd_s": t1 - t0,
               "bwd_s": t2 - t1, "step_s": t3 - t2, "start_s": t0, "storage_read": io1[0] - io0[0],
               "storage_written": io1[1] - io0[1],
               "host_storage_read": int(host_io[0]), "host_storage_written": int(host_io[1]),
               "loss_scale": float(getattr(engine.optimizer, "loss_scale", 1.0)),
               "skipped": bool(engine.optimizer.overflow),
               "grad_norm": float(engine.get_global_grad_norm() or 0.0),
               # smartinf: the part of the step spent in the pipeline (after DeepSpeed's
               # overflow check and norm)
               "pipeline_s": getattr(engine.optimizer, "last_step_seconds", None),
               # and where the rest of smartinf's step() went (see SmartInfinityStage3.step)
               "step_phases": getattr(engine.optimizer, "last_step_phases", None)}
        if the_pipeline() is not None:
            if choices is None:
                choices, predicted = described(the_pipeline())
            c1 = counters()
            rec["pipeline"] = difference(c1, c0)
        t4 = time.perf_counter()
        between["counters"] = t4 - t3
        rec["between"] = between  # seconds from t3 (data and last_record: their own)
        if watch is not None:
            rec.update(watch.take())
        records.append(rec)
        write_record(None)
        if rank == 0:
            print(f"step {rec['step']:4d}  loss {rec['loss']:.6f}  fwd {rec['fwd_s']:.3f}s  "
                  f"bwd {rec['bwd_s']:.3f}s  step {rec['step_s']:.3f}s  "
                  f"read {rec['storage_read'] / 1e6:.1f} MB  written "
                  f"{rec['storage_written'] / 1e6:.1f} MB", flush=True)
        if args.save and step + 1 == args.save_at:
            engine.save_checkpoint(args.save, client_state={"step": step + 1})
            c1, io1 = counters(), storage_bytes()  # the checkpoint's copies are no step's

    if profiler is not None:  # (the last step profiled: no iteration after it)
        profiler.stop(Path(args.json).with_suffix(".prof.txt"))
    if watch is not None:
        watch.stop()
    # smartinf with overlap: the last step's updates may still run; finish them, and count
    # what they moved
    io_end = io1
    if hasattr(engine.optimizer, "settle"):
        engine.optimizer.settle()
    io_settled = storage_bytes()
    write_record({"storage_read": io_settled[0] - io_end[0],
                  "storage_written": io_settled[1] - io_end[1]})
    if args.params_out:
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            if rank == 0:
                torch.save([q.detach().float().cpu().clone() for q in params], args.params_out)
    engine.destroy()


def settle_stream() -> None:
    """The current stream's work done (what the training loop waits for), not the device's:
    smartinf's updates still running on its own streams are the next phase's to wait for."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


def leave_without_teardown() -> None:
    """Everything is written: leave without running C++ static destructors, which in
    DeepSpeed 0.19's CPU ops (2 ranks, CPU Adam) abort now and then at exit ("terminate
    called without an active exception") after a successful run."""
    torch.distributed.destroy_process_group()
    # os._exit skips multiprocessing's exit, which ends daemonic children: ZenFlow's optimizer
    # process (--mode zenflow) outlived every run, waiting on its control block
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(5)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    leave_without_teardown()
