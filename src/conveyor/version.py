"""The package's version, in a module of its own: the processes that report it (the HTTP
face's ``/version``, the node link's join check) read it here without importing the package
facade (``conveyor/__init__.py``), which stands above everything as ``conveyor.Engine``."""

from __future__ import annotations

__version__ = "0.1.0"
