"""The shared-memory ring across spawned processes: readers each seeing every message in
order, a slow reader holding the writer back, a SIGKILLed reader among live ones dropped, a
dead writer noticed, and a silent exit (no leak warnings, no files left).

No torch: these run in the torch-free venv too. Children are ``spawn``ed, as bin/serve does.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conveyor.ipc import shm_ring
from conveyor.ipc.shm_ring import RingClosed, RingFull, RingReader, RingWriter, WriterDied
from tests.ipc.ring_helpers import check_stamped, stamped

SPAWN = mp.get_context("spawn")
CHILD_TIMEOUT_S = 20


# ---------------------------------------------------------------------------- children


def _read_all(path: str, zero_copy: bool, delay_s: float, out, index: int = 0) -> None:
    """Read as reader ``index`` until the ring closes; report (count, digest of the ordered
    messages, error)."""
    digest, count = hashlib.sha256(), 0
    try:
        with RingReader(path, index, liveness_interval_s=0.05) as reader:
            while True:
                try:
                    if zero_copy:
                        msg = reader.view(timeout=CHILD_TIMEOUT_S)
                        if msg is None:
                            raise TimeoutError("no message")
                        check_stamped(msg, reader.position)
                        digest.update(msg)
                        reader.advance()
                    else:
                        msg = reader.recv(timeout=CHILD_TIMEOUT_S)
                        if msg is None:
                            raise TimeoutError("no message")
                        check_stamped(msg, count)
                        digest.update(msg)
                except RingClosed:
                    break
                count += 1
                if delay_s:
                    time.sleep(delay_s)
        out.put((count, digest.hexdigest(), None))
    except BaseException as exc:
        out.put((count, digest.hexdigest(), repr(exc)))


def _read_some_then_hang(path: str, n: int, done, index: int = 0) -> None:
    reader = RingReader(path, index)
    for i in range(n):
        check_stamped(reader.recv(timeout=CHILD_TIMEOUT_S), i)
    done.set()
    time.sleep(60)  # holds its cursor until killed


def _write_some_then_hang(path: str, n: int, done) -> None:
    writer = RingWriter(path)
    rng = random.Random(1)
    for i in range(n):
        writer.send(stamped(i, 100, rng))
    done.set()
    time.sleep(60)


# ---------------------------------------------------------------------------- spawned processes


def test_spawned_readers_each_see_every_message_in_order(ring_dir: str) -> None:
    """Reader 0 zero-copy, reader 1 copying, each in its own spawned process (two TP ranks)."""
    path = os.path.join(ring_dir, "ring")
    rng = random.Random(5)
    num_messages = 3000
    outs = [SPAWN.Queue(), SPAWN.Queue()]
    with RingWriter.create(path, slot_bytes=2048, num_slots=8, num_readers=2) as writer:
        procs = [SPAWN.Process(target=_read_all, args=(path, i == 0, 0.0, outs[i], i)) for i in range(2)]
        for proc in procs:
            proc.start()  # readers attach whenever they are up; until then their slots wait for them
        digest = hashlib.sha256()
        for seq in range(num_messages):
            payload = stamped(seq, rng.randint(12, 2048), rng)
            writer.send(payload, timeout=CHILD_TIMEOUT_S)
            digest.update(payload)
    results = [out.get(timeout=CHILD_TIMEOUT_S) for out in outs]
    for proc in procs:
        proc.join(CHILD_TIMEOUT_S)
    assert results == [(num_messages, digest.hexdigest(), None)] * 2


def test_slow_spawned_reader_holds_the_writer_back(ring_dir: str) -> None:
    path = os.path.join(ring_dir, "ring")
    rng = random.Random(6)
    num_slots, num_messages, delay_s = 4, 40, 0.005
    out = SPAWN.Queue()
    with RingWriter.create(path, slot_bytes=1024, num_slots=num_slots) as writer:
        proc = SPAWN.Process(target=_read_all, args=(path, False, delay_s, out))
        proc.start()
        digest = hashlib.sha256()
        waited = 0.0
        for seq in range(num_messages):
            payload = stamped(seq, rng.randint(12, 1024), rng)
            start = time.monotonic()
            writer.send(payload, timeout=CHILD_TIMEOUT_S)
            waited += time.monotonic() - start
            digest.update(payload)
            assert writer.position - writer.reader_status().position <= num_slots
    assert out.get(timeout=CHILD_TIMEOUT_S) == (num_messages, digest.hexdigest(), None)
    proc.join(CHILD_TIMEOUT_S)
    # The reader sleeps 5 ms per message: the writer waited for most of them.
    assert waited >= (num_messages - num_slots) * delay_s * 0.8


def test_sigkilled_reader_is_dropped_and_the_writer_proceeds(ring_dir: str) -> None:
    path = os.path.join(ring_dir, "ring")
    rng = random.Random(7)
    num_slots = 4
    done = SPAWN.Event()
    writer = RingWriter.create(path, slot_bytes=256, num_slots=num_slots, num_readers=2, liveness_interval_s=0.05)
    with writer:
        survivor = RingReader(path, 1)  # a live rank keeps reading after another died
        victim = SPAWN.Process(target=_read_some_then_hang, args=(path, 2, done, 0))
        victim.start()
        seq = 0

        def send(timeout: float) -> None:
            nonlocal seq
            assert writer.send(stamped(seq, 100, rng), timeout=timeout) == seq
            check_stamped(survivor.recv(timeout=0), seq)
            seq += 1

        for _ in range(2):
            send(CHILD_TIMEOUT_S)
        assert done.wait(CHILD_TIMEOUT_S)
        for _ in range(num_slots):  # the victim has read 2: 4 more fill the ring
            send(0)
        with pytest.raises(RingFull):
            writer.send(b"blocked", timeout=0.2)  # alive and not reading: it holds the writer
        os.kill(victim.pid, signal.SIGKILL)  # not reaped yet: a zombie must count as dead too
        start = time.monotonic()
        send(CHILD_TIMEOUT_S)
        assert time.monotonic() - start < 2
        assert writer.reader_status().state == "dropped"
        assert [r.state for r in writer.readers()] == ["dropped", "attached"]
        for _ in range(3 * num_slots):  # nothing holds it back any more
            send(0)
        survivor.close()
    victim.join(CHILD_TIMEOUT_S)
    assert victim.exitcode == -signal.SIGKILL


def test_reader_notices_a_dead_writer(ring_dir: str) -> None:
    path = os.path.join(ring_dir, "ring")
    shm_ring.create_ring(path, slot_bytes=256, num_slots=8)  # created here, written by the child
    done = SPAWN.Event()
    proc = SPAWN.Process(target=_write_some_then_hang, args=(path, 3, done))
    try:
        with RingReader(path, liveness_interval_s=0.05) as reader:
            proc.start()
            assert done.wait(CHILD_TIMEOUT_S)
            for i in range(3):
                check_stamped(reader.recv(timeout=CHILD_TIMEOUT_S), i)
            assert reader.recv(timeout=0.1) is None  # alive, just quiet
            os.kill(proc.pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(WriterDied):
                reader.recv(timeout=None)  # even an unbounded wait ends
            assert time.monotonic() - start < 2
            assert not reader.writer_alive()
    finally:
        proc.join(CHILD_TIMEOUT_S)
        shm_ring.unlink_ring(path)


def test_exit_with_spawned_readers_is_silent(tmp_path) -> None:
    """No resource-tracker or leak warnings, and no files left, when children attach and exit."""
    script = tmp_path / "ring_exit.py"
    script.write_text(
        textwrap.dedent(
            """
            import multiprocessing as mp, os, sys, tempfile
            from conveyor.ipc.shm_ring import RingReader, RingWriter

            def child(path, index):
                reader = RingReader(path, index)
                assert reader.recv(timeout=20) == b"hi"
                # exits without close(): the attach must not leave anything behind either

            if __name__ == "__main__":
                d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
                writer = RingWriter.create(os.path.join(d, "ring"), slot_bytes=64, num_readers=2)
                procs = [mp.get_context("spawn").Process(target=child, args=(writer.path, i)) for i in range(2)]
                for proc in procs:
                    proc.start()
                writer.send(b"hi")
                for proc in procs:
                    proc.join(20)
                    assert proc.exitcode == 0, proc.exitcode
                # no close(): the owner's finalizer unlinks at exit
                print(d)
            """
        )
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    run_dir = proc.stdout.strip()
    assert os.listdir(run_dir) == []
    os.rmdir(run_dir)
