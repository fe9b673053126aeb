#!/usr/bin/env bash
# Side by side: the tree before issue 14 (/tmp/cv-before, c6a9807) and now, alternating.
set -u
OUT=/tmp/sbs
cd /work/main
for round in 1 2; do
  for side in before after; do
    if [ $side = before ]; then
      PYTHONPATH=/tmp/cv-before python3 /tmp/cv-before/conveyor/bench/scheduler.py --sizes 64,256 --repeat 3 --iters 600 > $OUT/sched-$side-$round.txt 2>&1
      PYTHONPATH=/tmp/cv-before python3 -m conveyor.bin.bench offline --workload high-variance --num-requests 64 --batch-size 32 --threads 1 --systems conveyor,static --no-progress --json $OUT/bench-$side-$round.json > $OUT/bench-$side-$round.txt 2>&1
    else
      python3 bench/scheduler.py --sizes 64,256 --repeat 3 --iters 600 > $OUT/sched-$side-$round.txt 2>&1
      python3 -m conveyor.cli.bench offline --workload high-variance --num-requests 64 --batch-size 32 --threads 1 --systems conveyor,static --no-progress --json $OUT/bench-$side-$round.json > $OUT/bench-$side-$round.txt 2>&1
    fi
  done
done
echo done > $OUT/DONE
