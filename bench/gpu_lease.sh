#!/bin/bash
# A run longer than one call on the lent GPU machine: a command's other processes are killed
# when it returns, the machine goes back ~30 s after a call, and a call cut short by the
# session's device time returns nothing it printed. So:
#
#   bash bench/gpu_lease.sh start 'bash bench/gpu_kit.sh setup' 'source bench/gpu_kit.sh env; ...'
#       (in the first call, carrying .devkit): the steps run one after another from a copy of
#       the tree in /tmp/lease/tree, in a session of their own (setsid), each step's output in
#       /tmp/lease/log; the env a step sources stays for the next (one shell runs them all)
#   bash bench/gpu_lease.sh start-file STEPS.txt
#       the same, the steps one a line in a file of the tree (a call's command line holds
#       2000 characters at most; an untracked file travels with the tree)
#   bash bench/gpu_lease.sh wait 540
#       (in each next call, made at once): waits until the steps are done or the seconds have
#       passed, copying the log and everything under /tmp/lease/out (give the steps
#       OUT=/tmp/lease/out) into $OUT every 10 s, so a call cut short still returns them
#       (files at most one folder below it: deeper ones do not come back from the machine,
#       so a step with a tree of records tars it, e.g. `tar czf /tmp/lease/out/r.tgz -C /tmp r`)
set -u
L=/tmp/lease
case ${1:-} in
  start-file)
    [ -f "${2:-}" ] || { echo "no steps file: ${2:-}" >&2; exit 2; }
    mapfile -t steps < "$2"
    exec bash "$0" start "${steps[@]}"
    ;;
  start)
    shift
    rm -rf "$L" && mkdir -p "$L/out" && cp -r . "$L/tree"
    printf '%s\n' "$@" > "$L/steps"
    (cd "$L/tree" && setsid bash -c '
      while IFS= read -r step <&3; do
        echo "== $(date +%T) $step"
        eval "$step" || echo "== step failed: rc $?"
      done 3< '"$L"'/steps
      echo "== done $(date +%T)"' > "$L/log" 2>&1 < /dev/null &)
    sleep 2; cat "$L/log"
    ;;
  wait)
    # a machine given back and started again has no lease: say so now, not after the wait
    [ -f "$L/log" ] || { echo "no lease on this machine ($L/log): it was started afresh" >&2; exit 3; }
    end=$(( $(date +%s) + ${2:-540} ))
    while :; do
      mkdir -p "${OUT:?}/lease" && cp -r "$L/out/." "$OUT/lease/" 2>/dev/null
      cp "$L/log" "$OUT/lease/log" 2>/dev/null
      if grep -q "^== done" "$L/log" 2>/dev/null; then  # (what the last step wrote after the copy)
        cp -r "$L/out/." "$OUT/lease/" 2>/dev/null; cp "$L/log" "$OUT/lease/log"; break
      fi
      [ "$(date +%s)" -ge "$end" ] && break
      sleep 10
    done
    tail -c 6000 "$L/log"
    ;;
  *) echo "usage: $0 start STEP... | start-file FILE | wait SECONDS" >&2; exit 2 ;;
esac
