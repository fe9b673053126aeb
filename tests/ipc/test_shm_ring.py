"""The shared-memory ring: round trips, wrap-around, oversize diversion order, one and several
readers (in spawned processes too), back-pressure from the slowest, a SIGKILLed reader among
live ones, a dead writer, and clean-up.

No torch: these run in the torch-free venv too. Children are ``spawn``ed, as bin/serve does.
"""

from __future__ import annotations

import gc
import hashlib
import multiprocessing as mp
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import zlib

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.ipc import shm_ring
from conveyor.ipc.shm_ring import (
    Diverted,
    MessageTooLarge,
    ReaderDropped,
    RingClosed,
    RingError,
    RingFull,
    RingReader,
    RingWriter,
    WriterDied,
)

SPAWN = mp.get_context("spawn")
CHILD_TIMEOUT_S = 20


def _base_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


@pytest.fixture
def ring_dir():
    with tempfile.TemporaryDirectory(prefix="conveyor-test-", dir=_base_dir()) as d:
        yield d


def stamped(seq: int, size: int, rng: random.Random) -> bytes:
    """A payload that says which message it is and carries its own checksum (>= 12 bytes)."""
    body = rng.randbytes(max(0, size - 12))
    return seq.to_bytes(8, "little") + zlib.crc32(body).to_bytes(4, "little") + body


def check_stamped(data: bytes | memoryview, seq: int) -> None:
    data = bytes(data)
    assert int.from_bytes(data[:8], "little") == seq
    assert int.from_bytes(data[8:12], "little") == zlib.crc32(data[12:])


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


# ---------------------------------------------------------------------------- in-process


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 4096), min_size=1, max_size=30), st.randoms(use_true_random=False))
def test_round_trip_random_sizes(sizes: list[int], rng: random.Random) -> None:
    with tempfile.TemporaryDirectory(dir=_base_dir()) as d:
        path = os.path.join(d, "ring")
        with RingWriter.create(path, slot_bytes=4096, num_slots=8) as writer, RingReader(path) as reader:
            for i, size in enumerate(sizes):
                payload = rng.randbytes(size)
                assert writer.send(payload) == i
                if rng.random() < 0.5:
                    assert reader.recv(timeout=0) == payload
                else:
                    view = reader.view(timeout=0)
                    assert isinstance(view, memoryview) and view == payload
                    reader.advance()
            assert reader.recv(timeout=0) is None


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copying", "zero_copy"])
def test_wrap_around_many_times_in_order(ring_dir: str, zero_copy: bool) -> None:
    path = os.path.join(ring_dir, "ring")
    rng = random.Random(0)
    num_messages, num_slots = 20_000, 4
    with RingWriter.create(path, slot_bytes=512, num_slots=num_slots) as writer, RingReader(path) as reader:
        seq = 0
        while seq < num_messages:
            burst = rng.randint(1, num_slots)  # never more than the ring holds
            for _ in range(min(burst, num_messages - seq)):
                assert writer.send(stamped(seq, rng.randint(12, 512), rng), timeout=0) == seq
                seq += 1
            while reader.position < seq:
                position = reader.position
                if zero_copy:
                    check_stamped(reader.view(timeout=0), position)
                    reader.advance()
                else:
                    check_stamped(reader.recv(timeout=0), position)
                assert reader.position == position + 1
        assert reader.recv(timeout=0) is None
        assert writer.position == num_messages == reader.position


def test_parts_are_written_back_to_back(ring_dir: str) -> None:
    import array

    path = os.path.join(ring_dir, "ring")
    with RingWriter.create(path, slot_bytes=256) as writer, RingReader(path) as reader:
        ids = array.array("i", [1, 2, 3, 70000])  # a non-byte buffer: written as its raw bytes
        writer.send([b"head", memoryview(b"--"), ids])
        assert reader.recv(timeout=0) == b"head--" + ids.tobytes()


def test_view_is_released_on_advance(ring_dir: str) -> None:
    path = os.path.join(ring_dir, "ring")
    with RingWriter.create(path, slot_bytes=64) as writer, RingReader(path) as reader:
        writer.send(b"hello")
        view = reader.view(timeout=0)
        assert reader.view(timeout=0) is view  # not consumed until advance
        assert bytes(view) == b"hello"
        reader.advance()
        with pytest.raises(ValueError):
            bytes(view)
        with pytest.raises(RingError):
            reader.advance()


def test_oversize_is_refused_and_publishes_nothing(ring_dir: str) -> None:
    path = os.path.join(ring_dir, "ring")
    with RingWriter.create(path, slot_bytes=100) as writer, RingReader(path) as reader:
        assert writer.max_payload == 100
        writer.send(b"a" * 100)  # exactly one slot fits
        with pytest.raises(MessageTooLarge):
            writer.send(b"b" * 101)
        with pytest.raises(MessageTooLarge):
            writer.send([b"b" * 60, b"c" * 41])
        assert writer.position == 1
        assert reader.recv(timeout=0) == b"a" * 100
        assert reader.recv(timeout=0) is None


def test_diverted_messages_keep_their_place_in_order(ring_dir: str) -> None:
    """Big messages go over ZeroMQ, small ones over the ring: the reader sees the sender's order."""
    path = os.path.join(ring_dir, "ring")
    address = f"ipc://{os.path.join(ring_dir, 'fallback')}"
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    pull.bind(address)
    push.connect(address)
    rng = random.Random(3)
    sent = [stamped(i, rng.choice([20, 200, 300, 5000]), rng) for i in range(300)]
    received: list[bytes] = []
    num_diverted = 0
    with RingWriter.create(path, slot_bytes=256, num_slots=4) as writer, RingReader(path) as reader:

        def take_available() -> None:
            nonlocal num_diverted
            while True:
                msg = reader.recv(timeout=0)
                if msg is None:
                    return
                if isinstance(msg, Diverted):
                    assert msg.index == num_diverted and msg.seq == len(received)
                    assert pull.poll(5000), "diverted message never arrived"
                    msg = pull.recv()
                    num_diverted += 1
                received.append(msg)

        try:
            for payload in sent:
                if rng.random() < 0.3 or writer.position - reader.position == 4:  # one thread: drain when full
                    take_available()
                writer.send(payload, timeout=0, divert=push.send)
            take_available()
        finally:
            for sock in (push, pull):
                sock.close(linger=0)
            ctx.term()
    assert received == sent
    assert num_diverted == sum(len(p) > 256 for p in sent) > 0


def test_divert_waits_for_a_slot_first_and_a_failed_divert_publishes_nothing(ring_dir: str) -> None:
    path = os.path.join(ring_dir, "ring")
    diverted: list[bytes] = []
    with RingWriter.create(path, slot_bytes=16, num_slots=2) as writer, RingReader(path) as reader:
        writer.send(b"1")
        writer.send(b"2")
        with pytest.raises(RingFull):  # no slot for the marker: the big message must not leave either
            writer.send(b"x" * 100, timeout=0, divert=diverted.append)
        assert diverted == []

        def broken(_: object) -> None:
            raise ConnectionError("fallback down")

        assert reader.recv(timeout=0) == b"1"
        with pytest.raises(ConnectionError):
            writer.send(b"y" * 100, divert=broken)
        writer.send(b"z" * 100, divert=diverted.append)
        assert reader.recv(timeout=0) == b"2"
        assert reader.recv(timeout=0) == Diverted(seq=2, index=0)  # the failed one left no marker
        assert diverted == [b"z" * 100]


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
    with RingWriter.create(os.path.join(ring_dir, "forgotten-reader"), slot_bytes=64, num_slots=2, num_readers=2) as writer:
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
