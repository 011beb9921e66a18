#!/bin/bash
# Alternate two code bases' `benchmarks/memtier.py saves` runs (ORDER: base new new base ...), one JSON
# line a run appended to OUT. BASE, NEW: directories holding each side's `asyncckpt` package (here:
# `git archive 1a3cb7d asyncckpt` unpacked, and the i30 worktree); BENCH: the worktree whose
# benchmarks/ and tests/ run (the same for both sides). Runs from /tmp so that neither side's
# package shadows the other through the current directory. Needs root (mount namespaces).
set -u
out=$(realpath -m "${OUT:-runs.jsonl}")
cd /tmp
for side in ${ORDER:-base new new base}; do
  if [ "$side" = base ]; then pp=$BASE; else pp=$NEW; fi
  t0=$(date +%s)
  line=$(TESTS_WARM_RANKS=0 PYTHONPATH=$pp timeout 900 python "$BENCH/benchmarks/memtier.py" saves \
         "${MIB:-256}" "${GAP:-0}" "${STEPS:-6}" 2>>"$out.err" | tail -n 1)
  echo "{\"side\": \"$side\", \"load\": \"$(cut -d' ' -f1-3 /proc/loadavg)\", \"wall_s\": $(( $(date +%s) - t0 )), \"run\": $line}" >> "$out"
  echo "$side done $(date -u +%T)"
done
