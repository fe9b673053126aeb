"""What the shared-memory ring's test modules share: where their rings live and the stamped
payloads that let a reader check it got the right message, whole (no torch: these run in the
torch-free venv too)."""

from __future__ import annotations

import os
import random
import zlib


def ring_base_dir() -> str | None:
    """A memory filesystem when there is one, as the serving processes use."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def stamped(seq: int, size: int, rng: random.Random) -> bytes:
    """A payload that says which message it is and carries its own checksum (>= 12 bytes)."""
    body = rng.randbytes(max(0, size - 12))
    return seq.to_bytes(8, "little") + zlib.crc32(body).to_bytes(4, "little") + body


def check_stamped(data: bytes | memoryview, seq: int) -> None:
    data = bytes(data)
    assert int.from_bytes(data[:8], "little") == seq
    assert int.from_bytes(data[8:12], "little") == zlib.crc32(data[12:])
