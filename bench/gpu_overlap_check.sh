#!/bin/bash
# On a lent GPU machine, before timing anything: the updates started during backward on the
# GPU paths are exact. tests/test_speculation.py (smartinf.optim, CUDA params), then the
# DeepSpeed example on the tiny model, overlap against --no-overlap (bf16 streamed and
# resident, fp16 with an injected overflow, clipping acting): the same losses and final
# params, printed side by side, with the updates started during backward and those
# finished while the next forward ran. Environment as for gpu_headtohead.sh.
# GPUS: ranks, one a GPU (default 1), both runs of a case alike (each at the same world size)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; GPUS=${GPUS:-1}
# ONLY: the cases whose names begin with it, without the pytest run
ONLY=${ONLY:-}
[ -n "$ONLY" ] || python3 -m pytest -q -p no:cacheprovider tests/test_speculation.py 2>&1 | tail -5
# name -> flags: bf16 streamed / resident, fp16 loss scaling with an injected overflow
# (step 3's NaN loss: inf gradients, the step skipped; DeepSpeed's hysteresis keeps the
# scale at a first overflow), clipping acting; and with clipping acting, a GPU budget and
# states in host memory the GPU updates (fp32, int8 + split): those finish while the next
# forward runs (deferred), in place in their partitions (-shared: half of those bytes on the
# GPU, the rest on the host's cores, at once); and those with the params in host
# memory (ZeRO-3's offload_param): the GPU reads the gradients in its buffer and writes the
# params into their host partitions (-shared: half of them on the host's cores, which read
# the gradients over PCIe and write the params where they lie).
CASES=("tiny|--dtype bf16 --clip 0" "tiny-resident|--dtype bf16 --clip 0 --memory-budget 64MiB"
       "tiny-fp16|--dtype fp16 --clip 0 --nan-at 3"
       "tiny-fp16-resident|--dtype fp16 --clip 0 --nan-at 3 --memory-budget 64MiB"
       "tiny-clipped|--dtype bf16 --clip 0.05"
       "tiny-gpu-host|--dtype bf16 --clip 0.05 --gpu-memory-budget 1MiB --memory-budget 64MiB --gpu-host-states on"
       "tiny-gpu-host-int8-split|--dtype bf16 --clip 0.05 --state-dtype int8 --split-master --gpu-memory-budget 512KiB --memory-budget 64MiB --gpu-host-states on"
       "tiny-gpu-host-shared|--dtype bf16 --clip 0.05 --state-dtype int8 --split-master --gpu-memory-budget 512KiB --memory-budget 1MiB --gpu-host-states 0.5"
       "tiny-offload-param|--dtype bf16 --clip 0.05 --offload-param --memory-budget 64MiB"
       "tiny-offload-param-gpu-host|--dtype bf16 --clip 0.05 --offload-param --gpu-memory-budget 1MiB --memory-budget 64MiB --gpu-host-states on"
       "tiny-offload-param-gpu-host-int8-split|--dtype bf16 --clip 0.05 --offload-param --state-dtype int8 --split-master --gpu-memory-budget 512KiB --memory-budget 64MiB --gpu-host-states on"
       "tiny-offload-param-gpu-host-shared|--dtype bf16 --clip 0.05 --offload-param --state-dtype int8 --split-master --gpu-memory-budget 512KiB --memory-budget 1MiB --gpu-host-states 0.5")
CASES=($(for case in "${CASES[@]}"; do [[ $case == "$ONLY"* ]] && echo "${case// /@}"; done))
CASES=("${CASES[@]//@/ }")
for case in "${CASES[@]}"; do
  for overlap in "" "--no-overlap"; do
    name="${case%%|*}${overlap:+-sync}"
    python3 -m torch.distributed.run --standalone --nproc_per_node="$GPUS" examples/deepspeed/train.py --model tiny \
      --steps 8 --sub-group-size 60000 --dir "/tmp/states/$name" --if-exists overwrite \
      --json "$OUT/$name.json" --params-out "/tmp/$name.pt" ${case#*|} $overlap > "/tmp/$name.log" 2>&1 \
      || { echo "$name failed"; tail -30 "/tmp/$name.log"; }
  done
done
python3 - "$OUT" "${CASES[@]}" <<'PY'
import json, sys, torch
for case in sys.argv[2:]:
    name = case.split("|")[0]
    on, off = (json.load(open(f"{sys.argv[1]}/{n}.json"))["steps"] for n in (name, name + "-sync"))
    same = [str(a["loss"]) == str(b["loss"]) for a, b in zip(on, off)]  # NaN: the injected step
    p_on, p_off = (torch.load(f"/tmp/{n}.pt") for n in (name, name + "-sync"))
    bits = all(torch.equal(a, b) for a, b in zip(p_on, p_off)) and len(p_on) == len(p_off)
    print(name, "losses equal:", all(same), "params equal:", bits, "skipped", [s["skipped"] for s in on],
          "scale", [s["loss_scale"] for s in on],
          "speculative", [s["pipeline"]["speculative_updates"] for s in on],
          "retracted", [s["pipeline"]["retracted_updates"] for s in on],
          "deferred", [s["pipeline"]["deferred_updates"] for s in on],
          "gather waits", [s["pipeline"]["gather_waits"] for s in on])
PY
