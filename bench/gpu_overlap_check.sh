#!/bin/bash
# On a lent GPU machine, before timing anything: the updates started during backward on the
# GPU paths are exact. tests/test_speculation.py (smartinf.optim, CUDA params), then the
# DeepSpeed example on the tiny model, bf16, overlap against --no-overlap (streamed and
# resident): the same losses, printed side by side, with the updates started during backward
# and those finished while the next forward ran. Environment as for gpu_headtohead.sh.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pytest -q -p no:cacheprovider tests/test_speculation.py 2>&1 | tail -5
for extra in "" "--memory-budget 64MiB"; do
  for overlap in "" "--no-overlap"; do
    name="tiny${extra:+-resident}${overlap:+-sync}"
    python3 -m torch.distributed.run --nproc_per_node=1 examples/deepspeed/train.py --model tiny \
      --dtype bf16 --clip 0 --steps 8 --sub-group-size 60000 --dir "/tmp/states/$name" \
      --if-exists overwrite --json "$OUT/$name.json" $extra $overlap > "/tmp/$name.log" 2>&1 \
      || { echo "$name failed"; tail -30 "/tmp/$name.log"; }
  done
done
python3 - "$OUT" <<'PY'
import json, sys
for name in ("tiny", "tiny-resident"):
    on, off = (json.load(open(f"{sys.argv[1]}/{n}.json"))["steps"] for n in (name, name + "-sync"))
    same = [a["loss"] == b["loss"] for a, b in zip(on, off)]
    print(name, "losses equal:", all(same), "speculative", [s["pipeline"]["speculative_updates"] for s in on],
          "retracted", [s["pipeline"]["retracted_updates"] for s in on],
          "deferred", [s["pipeline"]["deferred_updates"] for s in on],
          "gather waits", [s["pipeline"]["gather_waits"] for s in on])
PY
