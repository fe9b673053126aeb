from __future__ import annotations

import subprocess
import sys


def test_scheduler_does_not_import_torch():
    code = (
        "import sys; import conveyor.scheduler.scheduler, conveyor.scheduler.policy, "
        "conveyor.scheduler.block_pool, conveyor.scheduler.request, conveyor.scheduler.main; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
