#!/usr/bin/env bash
# Everything a lent GPU owes the project, staged under one deadline: bench/gpu_checks.py runs it,
# bench/gpu_stages.py is the plan; docs/gpu-first-light.md gives the device tool's exact call
# and what to look for in the results. Flags go to the driver: --deadline S (default 420),
# --window 2 (compiled HF, a later call), --stages a,b (a rerun), --cpu (the dry run CI makes).
#
# The device image lacks some packages (bench/gpu-wheels.txt): `make gpu-wheels` here puts their
# wheels in .whl/ (git-ignored), the call's carry names it, and whatever .whl/ holds is
# installed first (the preflight names any module still missing and stops). The device gets
# the working tree without .git: write the commit to bench/COMMIT before sending.
# Results: $OUT/gpu-results.tgz and $OUT/summary.txt, rewritten after every stage.
set -uo pipefail
cd "$(dirname "$0")/.."
# The interpreter: $PYTHON (the tests pass their own, a venv's python needs no activation), else python3.
PYTHON="${PYTHON:-python3}"
# Not for --cpu: the wheels are built for the device's Python 3.12, not this machine's.
if compgen -G ".whl/*.whl" > /dev/null && [[ " $* " != *" --cpu "* ]]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || echo "gpu_checks: installing the carried wheels failed (the preflight names what is missing)" >&2
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PYTHON" bench/gpu_checks.py "$@"
