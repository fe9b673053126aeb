#!/usr/bin/env bash
# Everything a lent GPU owes the project, staged under one deadline: bench/gpu_checks.py says
# what runs and why; docs/benchmarks.md ("What the GPU owes") says how to call it through the
# device tool. Flags go to the driver: --deadline S (default 420), --cpu (the dry run CI makes).
# Before a window, read docs/gpu-first-light.md: the risks found from the CPU and what to look for.
#
# The device image lacks pyzmq and msgspec: carry them as wheels in .whl/ (ignored by git);
# whatever .whl/ holds is installed here first. The device gets a copy of the working tree
# without .git: write the commit to bench/COMMIT before sending (git rev-parse --short HEAD).
# Results: $OUT/gpu-results.tgz and $OUT/summary.txt, rewritten after every stage.
set -uo pipefail
cd "$(dirname "$0")/.."
# The interpreter: $PYTHON (the tests pass their own, a venv's python needs no activation), else python3.
PYTHON="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || echo "gpu_checks: installing the carried wheels failed (the preflight names what is missing)" >&2
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PYTHON" bench/gpu_checks.py "$@"
