"""The shared-memory ring's readers, in process: back-pressure from a full ring and from the
slowest of several readers, closed, dropped and pending readers, diverted messages reaching
every reader, the doorbell that wakes a blocked reader (and an external poller's), and a timed
wait while the writer lives.

No torch: these run in the torch-free venv too.
"""

from __future__ import annotations

import os
import random
import select
import threading
import time

import pytest

from conveyor.ipc import shm_ring
from conveyor.ipc.shm_ring import Diverted, ReaderDropped, RingFull, RingReader, RingWriter
from tests.ipc.ring_helpers import check_stamped, stamped


def test_full_ring_applies_back_pressure_in_process(ring_dir: str) -> None:
    path = os.path.join(ring_dir, "ring")
    with RingWriter.create(path, slot_bytes=64, num_slots=4) as writer:
        reader = RingReader(path)
        for i in range(4):
            writer.send(bytes([i]))
        start = time.monotonic()
        with pytest.raises(RingFull):
            writer.send(b"\x04", timeout=0.05)  # the reader still holds message 0
        assert time.monotonic() - start >= 0.05
        assert writer.position == 4
        assert reader.recv(timeout=0) == b"\x00"
        writer.send(b"\x04", timeout=0)
        with pytest.raises(RingFull):
            writer.send(b"\x05", timeout=0)  # one slot freed, one message let through
        assert [reader.recv(timeout=0) for _ in range(5)] == [b"\x01", b"\x02", b"\x03", b"\x04", None]
        reader.close()  # a closed reader holds nothing
        for i in range(5, 12):
            writer.send(bytes([i]), timeout=0)
        assert writer.reader_status().state == "detached"


def test_every_reader_sees_every_message_and_the_slowest_holds_the_writer(ring_dir: str) -> None:
    """Two readers, one copying and one zero-copy, each at its own pace: both see every message
    in order, and a slot is reused only once both have consumed it."""
    path = os.path.join(ring_dir, "ring")
    rng = random.Random(11)
    num_messages, num_slots = 5_000, 4
    with RingWriter.create(path, slot_bytes=512, num_slots=num_slots, num_readers=2) as writer:
        copying, zero_copy = RingReader(path, 0), RingReader(path, 1)
        seq = 0
        while seq < num_messages:
            while seq < num_messages:
                try:
                    writer.send(stamped(seq, rng.randint(12, 512), rng), timeout=0)
                except RingFull:
                    assert seq - min(copying.position, zero_copy.position) == num_slots
                    break
                seq += 1
            for _ in range(rng.randint(0, seq - copying.position)):
                check_stamped(copying.recv(timeout=0), copying.position - 1)
            for _ in range(rng.randint(0, seq - zero_copy.position)):
                check_stamped(zero_copy.view(timeout=0), zero_copy.position)
                zero_copy.advance()
            assert [r.position for r in writer.readers()] == [copying.position, zero_copy.position]
        for reader in (copying, zero_copy):
            while reader.position < seq:
                check_stamped(reader.recv(timeout=0), reader.position - 1)
            assert reader.recv(timeout=0) is None
            reader.close()
        assert [r.state for r in writer.readers()] == ["detached", "detached"]


def test_a_closed_reader_no_longer_holds_the_others_back(ring_dir: str) -> None:
    path = os.path.join(ring_dir, "ring")
    with RingWriter.create(path, slot_bytes=64, num_slots=4, num_readers=2) as writer:
        fast, slow = RingReader(path, 0), RingReader(path, 1)
        for i in range(4):
            writer.send(bytes([i]))
        for i in range(4):
            assert fast.recv(timeout=0) == bytes([i])
        with pytest.raises(RingFull, match="waits for"):
            writer.send(b"\x04", timeout=0.05)  # the slow reader still holds message 0
        assert writer.position == 4
        assert slow.recv(timeout=0) == b"\x00"
        writer.send(b"\x04", timeout=0)
        assert fast.recv(timeout=0) == b"\x04"
        assert [slow.recv(timeout=0) for _ in range(5)] == [b"\x01", b"\x02", b"\x03", b"\x04", None]
        slow.close()  # a closed reader holds nothing
        for i in range(5, 12):
            writer.send(bytes([i]), timeout=0)
            assert fast.recv(timeout=0) == bytes([i])
        fast.close()


def test_diverted_messages_reach_every_reader_in_order(ring_dir: str) -> None:
    """``divert`` hands a big message to each reader's own fallback queue; both readers pair
    the k-th marker with their k-th fallback message."""
    path = os.path.join(ring_dir, "ring")
    rng = random.Random(13)
    sent = [stamped(i, rng.choice([20, 300]), rng) for i in range(40)]
    fallback: list[list[bytes]] = [[], []]

    def divert(payload) -> None:
        for queue in fallback:
            queue.append(bytes(payload))

    with RingWriter.create(path, slot_bytes=256, num_slots=64, num_readers=2) as writer:
        readers = [RingReader(path, 0), RingReader(path, 1)]
        for payload in sent:
            writer.send(payload, timeout=0, divert=divert)
        for index, reader in enumerate(readers):
            received = []
            while (msg := reader.recv(timeout=0)) is not None:
                if isinstance(msg, Diverted):
                    msg = fallback[index].pop(0)
                received.append(msg)
            assert received == sent and fallback[index] == []
            reader.close()


def test_a_dropped_reader_never_returns_overwritten_data(ring_dir: str, monkeypatch) -> None:
    path = os.path.join(ring_dir, "ring")
    with RingWriter.create(path, slot_bytes=64, num_slots=2) as writer, RingReader(path) as dropped:
        writer.send(b"kept")
        view = dropped.view(timeout=0)
        assert bytes(view) == b"kept"
        # Wrongly presumed dead: the writer's liveness check, reached on a full ring, drops it.
        monkeypatch.setattr(shm_ring, "pid_alive", lambda pid, start_time=0: False)
        for i in range(3):
            writer.send(bytes([i]), timeout=0)  # its slots are free for reuse
        assert writer.reader_status().state == "dropped"
        dropped.advance()
        with pytest.raises(ReaderDropped):
            dropped.recv(timeout=0)  # its next slot holds a later message


def test_pending_reader_holds_messages_until_it_attaches(ring_dir: str) -> None:
    path = os.path.join(ring_dir, "ring")
    with RingWriter.create(path, slot_bytes=64, num_slots=3) as writer:
        for i in range(3):
            writer.send(bytes([i]))  # nobody attached yet: the declared reader's slots wait for it
        with pytest.raises(RingFull):
            writer.send(b"late", timeout=0)
        assert writer.reader_status().state == "pending"
        with RingReader(path) as reader:
            assert [reader.recv(timeout=0) for _ in range(3)] == [b"\x00", b"\x01", b"\x02"]


def test_blocked_reader_is_woken_by_its_doorbell(ring_dir: str) -> None:
    path = os.path.join(ring_dir, "ring")
    with RingWriter.create(path, slot_bytes=64) as writer:
        # spin 0 and a 30 s liveness slice: only the doorbell can end this wait early.
        with RingReader(path, spin_us=0, liveness_interval_s=30) as reader:
            timer = threading.Timer(0.1, writer.send, args=(b"ding",))
            start = time.monotonic()
            timer.start()
            assert reader.recv(timeout=10) == b"ding"
            assert time.monotonic() - start < 2
            timer.join()


def test_arm_and_fileno_for_an_external_poller(ring_dir: str) -> None:
    path = os.path.join(ring_dir, "ring")
    with RingWriter.create(path, slot_bytes=64) as writer, RingReader(path) as reader:
        assert reader.arm() is False
        assert select.select([reader], [], [], 0)[0] == []
        writer.send(b"a")
        assert select.select([reader], [], [], 5)[0] == [reader]
        assert reader.arm() is True  # a message is there: do not sleep
        reader.disarm()
        assert reader.recv(timeout=0) == b"a"
        writer.send(b"b")  # disarmed: no ring, but the message is there
        assert select.select([reader], [], [], 0)[0] == [] and reader.ready()


def test_timed_wait_returns_none_while_the_writer_lives(ring_dir: str) -> None:
    path = os.path.join(ring_dir, "ring")
    with RingWriter.create(path, slot_bytes=64), RingReader(path, liveness_interval_s=0.02) as reader:
        start = time.monotonic()
        assert reader.recv(timeout=0.1) is None
        assert 0.1 <= time.monotonic() - start < 2
        assert reader.writer_alive()
