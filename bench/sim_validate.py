#!/usr/bin/env python3
"""conveyor-sim beside bin/bench in one command (:mod:`conveyor_tools.sim.validate` says how):

python3 bench/sim_validate.py run --out bench/results/sim-validation-cpu/
python3 bench/sim_validate.py evaluate bench/results/sim-validation-cpu/
"""

from __future__ import annotations

from conveyor_tools.sim.validate import main

if __name__ == "__main__":
    raise SystemExit(main())
