"""The shared-memory ring's life cycle, in process: close drains then ends (idempotently),
endpoints dropped without close are finalized, a non-owner leaves the files, attach errors,
another layout version is refused, where rings are placed, and the liveness check of a pid.

No torch: these run in the torch-free venv too.
"""

from __future__ import annotations

import gc
import os

import pytest

from conveyor.ipc import shm_ring
from conveyor.ipc.shm_ring import RingClosed, RingError, RingReader, RingWriter


def test_close_drains_then_ends_and_everything_is_idempotent(ring_dir: str) -> None:
    path = os.path.join(ring_dir, "ring")
    writer = RingWriter.create(path, slot_bytes=64, num_readers=2)
    reader = RingReader(path, 0)
    assert sorted(os.listdir(ring_dir)) == ["ring", "ring.bell0", "ring.bell1"]
    writer.send(b"last")
    writer.close()
    writer.close()
    assert os.listdir(ring_dir) == []  # the owner unlinked file and doorbells; the mapping lives on
    with pytest.raises(RingError):
        writer.send(b"more")
    assert reader.recv(timeout=5) == b"last"
    with pytest.raises(RingClosed):
        reader.recv(timeout=5)
    with pytest.raises(RingClosed):
        reader.recv(timeout=0)
    reader.close()
    reader.close()
    shm_ring.unlink_ring(path)
    shm_ring.unlink_ring(path)
    with pytest.raises(FileNotFoundError):
        RingReader(path, 1)


def test_endpoints_dropped_without_close_are_finalized(ring_dir: str) -> None:
    with RingWriter.create(
        os.path.join(ring_dir, "forgotten-reader"), slot_bytes=64, num_slots=2, num_readers=2
    ) as writer:
        forgotten, kept = RingReader(writer.path, 0), RingReader(writer.path, 1)
        assert writer.reader_status().state == "attached"
        del forgotten
        gc.collect()
        assert writer.reader_status().state == "detached"
        assert [r.state for r in writer.readers()] == ["detached", "attached"]
        for i in range(5):  # the forgotten reader holds nothing
            writer.send(bytes([i]), timeout=0)
            assert kept.recv(timeout=0) == bytes([i])
        kept.close()
    path = os.path.join(ring_dir, "ring")
    writer = RingWriter.create(path, slot_bytes=64, num_slots=2)
    reader = RingReader(path)
    writer.send(b"last")
    del writer
    gc.collect()
    assert os.listdir(ring_dir) == []  # the owner's finalizer unlinked the ring
    assert reader.recv(timeout=5) == b"last"
    with pytest.raises(RingClosed):
        reader.recv(timeout=5)
    reader.close()


def test_non_owner_writer_leaves_the_files(ring_dir: str) -> None:
    path = os.path.join(ring_dir, "ring")
    shm_ring.create_ring(path, slot_bytes=64)
    with pytest.raises(FileExistsError):
        shm_ring.create_ring(path, slot_bytes=64)
    writer = RingWriter(path)
    with pytest.raises(RingError, match="already has a writer"):
        RingWriter(path)
    writer.close()
    assert sorted(os.listdir(ring_dir)) == ["ring", "ring.bell0"]
    shm_ring.unlink_ring(path)
    assert os.listdir(ring_dir) == []


def test_attach_errors(ring_dir: str) -> None:
    path = os.path.join(ring_dir, "ring")
    with RingWriter.create(path, slot_bytes=64):
        with RingReader(path):
            with pytest.raises(RingError, match="attaches once"):
                RingReader(path)
        with pytest.raises(RingError, match="attaches once"):
            RingReader(path)  # detached: each index attaches once in the ring's life
        with pytest.raises(RingError, match="out of range"):
            RingReader(path, 1)
    junk = os.path.join(ring_dir, "junk")
    with open(junk, "wb") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(RingError, match="not a conveyor ring"):
        RingReader(junk)
    with pytest.raises(ValueError):
        shm_ring.create_ring(os.path.join(ring_dir, "bad"), slot_bytes=4)


def test_a_ring_of_another_layout_version_is_refused(ring_dir: str) -> None:
    path = os.path.join(ring_dir, "ring")
    shm_ring.create_ring(path, slot_bytes=64)
    with open(path, "r+b") as f:
        f.seek(8)  # the version word
        f.write((shm_ring.VERSION - 1).to_bytes(8, "little"))
    with pytest.raises(RingError, match=f"ring version {shm_ring.VERSION - 1}, expected {shm_ring.VERSION}"):
        RingReader(path)
    with pytest.raises(RingError, match="ring version"):
        RingWriter(path)
    shm_ring.unlink_ring(path)


def test_ring_path_prefers_a_memory_filesystem(tmp_path) -> None:
    if os.path.isdir("/dev/shm"):
        assert shm_ring.ring_path("/dev/shm", "plans") == "/dev/shm/plans"
    path = shm_ring.ring_path(str(tmp_path), "plans")
    assert path.endswith("plans") and os.path.isdir(os.path.dirname(path))


def test_pid_alive() -> None:
    assert shm_ring.pid_alive(os.getpid())
    assert shm_ring.pid_alive(os.getpid(), shm_ring._start_time(os.getpid()) or 0)
    assert not shm_ring.pid_alive(0)
    if os.path.isdir("/proc/self"):
        assert not shm_ring.pid_alive(os.getpid(), 1)  # same pid, another start time: reused
