"""The tiny checkpoint of the end-to-end tests, for bin/bench runs here too."""

from __future__ import annotations

from tests.e2e.conftest import tiny_checkpoint  # noqa: F401  (a fixture, used by name)
