"""Fixtures of the ipc tests: ``ring_dir``, a private directory for the shared-memory ring
tests' files, removed (with whatever a test left in it) when the test ends."""

from __future__ import annotations

import tempfile

import pytest

from tests.ipc.ring_helpers import ring_base_dir


@pytest.fixture
def ring_dir():
    with tempfile.TemporaryDirectory(prefix="conveyor-test-", dir=ring_base_dir()) as d:
        yield d
