"""Make this folder's helpers importable as top-level modules (tests run with
--import-mode=importlib and there is no __init__.py here)."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
