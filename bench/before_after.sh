#!/usr/bin/env bash
# bin/bench offline of two trees, interleaved rounds, one worker thread: a session's before/after
# (docs/benchmarks.md). BEFORE / AFTER: checkouts of the two trees (each run with its own src on
# PYTHONPATH, so the tree's own tools run it); OUT: where the JSON and logs go.
set -u
OUT=${OUT:-/tmp/bench-ab}
BEFORE=${BEFORE:-/tmp/before}
AFTER=${AFTER:-/tmp/cv-after}
mkdir -p "$OUT"
ARGS=(offline --workload fixed --prompt-len 64 --output-len 64 --num-requests 64 --batch-size 32 --systems conveyor --no-progress --serve-arg=--threads --serve-arg=1)
for round in 1 2 3; do
  PYTHONPATH=$BEFORE/src python3 -m conveyor_tools.cli.bench "${ARGS[@]}" --json $OUT/before-$round.json > $OUT/before-$round.txt 2>&1
  PYTHONPATH=$AFTER/src python3 -m conveyor_tools.cli.bench "${ARGS[@]}" --json $OUT/after-$round.json > $OUT/after-$round.txt 2>&1
done
python3 - "$OUT" <<'PY'
import json, sys, statistics
from pathlib import Path
out = Path(sys.argv[1])
for side in ("before", "after"):
    vals = []
    for f in sorted(out.glob(f"{side}-*.json")):
        r = json.loads(f.read_text())
        vals.append(r["systems"]["conveyor"]["median"]["output_tok_s"])
    print(side, [round(v) for v in vals], "median", round(statistics.median(vals)) if vals else None)
PY
