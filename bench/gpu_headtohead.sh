#!/bin/bash
# The DeepSpeed head-to-head on a lent GPU machine (GPT-2 XL shape, bf16, batch 8 x 1024,
# ZeRO-3, one NVMe): each named mode runs examples/deepspeed/train.py (the fsdp2-* modes
# examples/fsdp/train.py, FSDP2) on fresh directories, one after another on the same machine; its record goes to
# $OUT/<mode>-g<GPUS>.json (summarise with bench/deepspeed_report.py). Environment first, in
# the same run: `bash bench/gpu_kit.sh setup && source bench/gpu_kit.sh env` (carry .devkit).
#
#   bash bench/gpu_headtohead.sh zero-offload int8-all-k10 ...
#   GPUS=2 bash bench/gpu_headtohead.sh zero-offload fp32-all-k10
#
# GPUS: ranks, one a GPU (default 1; more: torch.distributed.run --standalone, weak scaling,
# BATCH per GPU; each rank's states in its own sub-directory, rank<R>; OMP_NUM_THREADS, where
# unset, the host's cores / GPUS, not torchrun's 1, for DeepSpeed's CPU Adam; smartinf
# takes the same share itself, from LOCAL_WORLD_SIZE);
# STATES: where states / swap files go (default /tmp/states, removed after each mode);
# STEPS: iterations per mode (default 6; 12 for the commit_every=10 modes, so that one
# durable commit is among them; 21 or more gives deepspeed_report's model comparison the
# whole second commit interval); MODEL, BATCH, SEQ: the model and batch (default gpt2-xl,
# 8, 1024); CLIP: gradient clipping (default 1.0; 0 turns it off, in every mode: a step
# after a clipped one starts no update during backward); EXTRA: flags added to every mode
# (e.g. "--zero-init --checkpoint-activations" for the large shapes); LIMIT: seconds a mode
# may run before it is stopped (default none: the peers at sizes they cannot hold). The
# runs' output goes to $OUT/run.log (what comes back from the machine is limited in files),
# and each mode's host memory and disk in use, every 5 s, to $OUT/<mode>-g<GPUS>.mem
# (seconds, MiB used by processes, MiB used on STATES' file system).
set -u
OUT=${OUT:-/tmp/out}; STATES=${STATES:-/tmp/states}; STEPS=${STEPS:-6}; GPUS=${GPUS:-1}
# (as docs/deepspeed.md runs the large shapes: a full GPU's fragments otherwise make the
# caching allocator free its cache and retry, a wait for every stream; the records count
# them, alloc_retries)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
if [ "$GPUS" -gt 1 ]; then
  LAUNCH="--standalone --nproc_per_node $GPUS"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / GPUS ))}
else
  LAUNCH="--nproc_per_node=1"
fi
mkdir -p "$OUT" "$STATES"
COMMON="--model ${MODEL:-gpt2-xl} --dtype bf16 --batch ${BATCH:-8} --seq ${SEQ:-1024} --clip ${CLIP:-1.0} --if-exists overwrite ${EXTRA:-}"
INT8_STATES=9400000000   # 1.56 B params x 6.03 B
FP32_STATES=18700000000  # 1.56 B params x 12 B

flags() {  # mode name -> train.py flags
  case $1 in
    zero-offload) echo "--mode deepspeed-cpu" ;;
    super-offload) echo "--mode super-offload" ;;
    # ZeRO-Offload at stage 2 with ZenFlow (its tutorial's settings; not exact by design:
    # compare its losses with an exact mode's); params whole on the GPU, so no --zero-init
    zenflow) echo "--mode zenflow" ;;
    zero-infinity) echo "--mode zero-infinity" ;;
    # ZeRO-Offload++: a quarter / half of the states updated on the GPU, the rest on the CPU
    zero-offload-pp-q) echo "--mode deepspeed-cpu --offload-ratio 0.75" ;;
    zero-offload-pp-h) echo "--mode deepspeed-cpu --offload-ratio 0.5" ;;
    # the same GPU memory for smartinf's states (sub-groups that fit: whole ones; with
    # twins where the model says so, smartinf.twins), the rest resident in host RAM; -sync:
    # overlap off; -notwins: the GPU's budget filled with sub-groups, no room for twins
    fp32-gpu-q-k10) echo "--mode smartinf --gpu-memory-budget $((FP32_STATES / 4)) --memory-budget 40GiB --commit-every 10" ;;
    fp32-gpu-h-k10) echo "--mode smartinf --gpu-memory-budget $((FP32_STATES / 2)) --memory-budget 40GiB --commit-every 10" ;;
    fp32-gpu-q-k10-notwins) echo "--mode smartinf --gpu-memory-budget $((FP32_STATES / 4)) --memory-budget 40GiB --commit-every 10 --gpu-twins off" ;;
    fp32-gpu-h-k10-notwins) echo "--mode smartinf --gpu-memory-budget $((FP32_STATES / 2)) --memory-budget 40GiB --commit-every 10 --gpu-twins off" ;;
    fp32-gpu-q-k10-sync) echo "--mode smartinf --gpu-memory-budget $((FP32_STATES / 4)) --memory-budget 40GiB --commit-every 10 --no-overlap" ;;
    fp32-gpu-h-k10-sync) echo "--mode smartinf --gpu-memory-budget $((FP32_STATES / 2)) --memory-budget 40GiB --commit-every 10 --no-overlap" ;;
    # all three tiers (issue 27): a GPU budget, host memory for a quarter of the states'
    # bytes, the rest streamed from the NVMe
    fp32-gpu-q-tiers-k10) echo "--mode smartinf --gpu-memory-budget $((FP32_STATES / 4)) --memory-budget $((FP32_STATES / 4)) --commit-every 10" ;;
    fp32-gpu-h-tiers-k10) echo "--mode smartinf --gpu-memory-budget $((FP32_STATES / 2)) --memory-budget $((FP32_STATES / 4)) --commit-every 10" ;;
    # int8 + split, a quarter of the states in the GPU's memory, the rest in host memory the
    # GPU updates over PCIe (finished while the next forward runs)
    int8-split-gpu-host-k10) echo "--mode smartinf --state-dtype int8 --split-master --gpu-memory-budget $((INT8_STATES / 4)) --memory-budget 12GiB --gpu-host-states on --commit-every 10" ;;
    fp32-none) echo "--mode smartinf" ;;
    fp32-none-sync) echo "--mode smartinf --no-overlap" ;;
    int8-none) echo "--mode smartinf --state-dtype int8" ;;
    int8-half) echo "--mode smartinf --state-dtype int8 --memory-budget $((INT8_STATES / 2))" ;;
    fp32-half) echo "--mode smartinf --memory-budget $((FP32_STATES / 2))" ;;
    fp32-half-sync) echo "--mode smartinf --memory-budget $((FP32_STATES / 2)) --no-overlap" ;;
    int8-half-sync) echo "--mode smartinf --state-dtype int8 --memory-budget $((INT8_STATES / 2)) --no-overlap" ;;
    # -all: every state resident, with room for the second copy a background commit
    # (overlap, the default) updates while it writes the first, and a speculative update
    # works on; -sync: overlap off (no update during backward, commits written at once)
    int8-all-k1) echo "--mode smartinf --state-dtype int8 --memory-budget 20GiB" ;;
    int8-all-k10) echo "--mode smartinf --state-dtype int8 --memory-budget 20GiB --commit-every 10" ;;
    fp32-all-k1) echo "--mode smartinf --memory-budget 40GiB" ;;
    fp32-all-k10) echo "--mode smartinf --memory-budget 40GiB --commit-every 10" ;;
    fp32-all-k10-t15) echo "--mode smartinf --memory-budget 40GiB --commit-every 10 --compute-threads 15" ;;
    fp32-all-k10-t14) echo "--mode smartinf --memory-budget 40GiB --commit-every 10 --compute-threads 14" ;;
    fp32-all-k10-sync) echo "--mode smartinf --memory-budget 40GiB --commit-every 10 --no-overlap" ;;
    int8-all-k10-sync) echo "--mode smartinf --state-dtype int8 --memory-budget 20GiB --commit-every 10 --no-overlap" ;;
    int4-all-k10) echo "--mode smartinf --state-dtype int4 --memory-budget 20GiB --commit-every 10" ;;
    int8-split) echo "--mode smartinf --state-dtype int8 --split-master" ;;
    int8-split-sync) echo "--mode smartinf --state-dtype int8 --split-master --no-overlap" ;;
    int4-split) echo "--mode smartinf --state-dtype int4 --split-master" ;;
    fp32-split) echo "--mode smartinf --split-master" ;;
    # everything chosen: the format, master, memory and copies (state_dtype auto), the GPU's
    # budget (what DeepSpeed and the activations leave) and where the states in host memory
    # are updated ("host_states": "auto"), durable every 10 steps as auto sets it (run with
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as in docs/deepspeed.md)
    auto-gpu-k10) echo "--mode smartinf --state-dtype auto --gpu-memory-budget auto" ;;
    # the same, the states in host memory shared: 70 % of their bytes on the GPU, the rest on
    # the host's cores, both at once
    auto-gpu-cores30-k10) echo "--mode smartinf --state-dtype auto --gpu-memory-budget auto --gpu-host-states 0.7" ;;
    auto-gpu) echo "--mode smartinf --state-dtype auto --gpu-memory-budget auto" ;;  # (STEPS as given)
    # the same, the states in host memory updated by the host's cores alone, or half of
    # their bytes by the GPU (STEPS as given: an A/B of a few steps at the large shapes)
    auto-gpu-host-off) echo "--mode smartinf --state-dtype auto --gpu-memory-budget auto --gpu-host-states off" ;;
    auto-gpu-host-half) echo "--mode smartinf --state-dtype auto --gpu-memory-budget auto --gpu-host-states 0.5" ;;
    # FSDP2 (examples/fsdp/train.py): no offload (torch's fused AdamW on the GPU: the floor),
    # CPUOffloadPolicy (params, gradients and states on the host, torch's fused AdamW on its
    # cores), and smartinf.optim over the shards (bf16 shards, fp32 masters in its states)
    # what a user writes first: the block with only "devices" (DeepSpeed), the README's
    # smartinf.optim.AdamW(..., devices=, max_grad_norm=) (FSDP2): the planner's placement
    defaults) echo "--mode smartinf" ;;
    fsdp2-defaults) echo "--mode smartinf" ;;
    fsdp2-defaults-sync) echo "--mode smartinf --no-overlap" ;;
    fsdp2-none) echo "--mode fsdp" ;;
    fsdp2-cpu-offload) echo "--mode cpu-offload" ;;
    fsdp2-fp32-all-k10) echo "--mode smartinf --memory-budget 40GiB --commit-every 10" ;;
    fsdp2-auto-gpu-k10) echo "--mode smartinf --state-dtype auto --gpu-memory-budget auto" ;;
    fsdp2-auto-gpu-k10-sync) echo "--mode smartinf --state-dtype auto --gpu-memory-budget auto --no-overlap" ;;
    # the states in host memory shared: three quarters of their bytes on the GPU over PCIe,
    # the rest on the host's cores at once (the 13 B bound: fewer bytes cross)
    fsdp2-auto-gpu-host-3q) echo "--mode smartinf --state-dtype auto --gpu-memory-budget auto --gpu-host-states 0.75" ;;
    *) echo "unknown mode $1" >&2; return 1 ;;
  esac
}

for mode in "$@"; do
  f=$(flags "$mode") || exit 2
  # The defaults are the planner's (docs/configuration.md): the modes named for a placement
  # say what they leave out, as they meant before: no GPU budget where they name none,
  # streamed and durable every step where they name no memory, durable every step in -k1.
  case $f in *"--mode smartinf"*)
    case $mode in defaults|fsdp2-defaults*|auto-*|fsdp2-auto-*) ;; *)
      case $f in *--gpu-memory-budget*) ;; *) f="$f --gpu-memory-budget 0" ;; esac
      case $mode in fsdp2-*) ;; *) case $f in *--gpu-host-states*) ;; *) f="$f --gpu-host-states off" ;; esac ;; esac
      case $f in *--memory-budget*) ;; *) f="$f --memory-budget 0 --commit-every 1" ;; esac
      case $mode in *-k1|*-k1-*) f="$f --commit-every 1" ;; esac ;;
    esac ;;
  esac
  steps=$STEPS; case $mode in *-k10*) steps=$((STEPS > 12 ? STEPS : 12)) ;; esac
  run=$mode-g$GPUS
  start=$(date +%s)
  rm -rf "${STATES:?}/$run"
  while :; do
    echo "$(( $(date +%s) - start )) $(free -m | awk '/^Mem:/ {print $3}') $(df -m --output=used "$STATES" | tail -1)"
    sleep 5
  done > "$OUT/$run.mem" &
  sampler=$!
  script=examples/deepspeed/train.py; case $mode in fsdp2-*) script=examples/fsdp/train.py ;; esac
  timeout --kill-after=30 "${LIMIT:-0}" python3 -m torch.distributed.run $LAUNCH $script \
      $f $COMMON --steps "$steps" --dir "$STATES/$run" --json "$OUT/$run.json" > "$STATES/$run.log" 2>&1
  rc=$?
  kill $sampler
  # 124: stopped by timeout's TERM; 137 once the limit has passed: by its KILL, 30 s after
  # (an OOM kill also exits 137; past the limit the run was being stopped either way)
  if [ $rc = 124 ] || { [ $rc = 137 ] && [ "${LIMIT:-0}" != 0 ] && [ $(( $(date +%s) - start )) -ge "$LIMIT" ]; }; then
    echo "stopped after LIMIT=$LIMIT s (rc $rc)" >> "$STATES/$run.log"
  fi
  { echo "== $run: rc $rc, $(( $(date +%s) - start )) s"; cat "$STATES/$run.log"; } >> "$OUT/run.log"
  echo "== $run: rc $rc, $(( $(date +%s) - start )) s"
  grep -aE "^step " "$STATES/$run.log"
  [ $rc = 0 ] || tail -30 "$STATES/$run.log"
  rm -f "$STATES/$run.log"
  rm -rf "${STATES:?}/$run"
done
