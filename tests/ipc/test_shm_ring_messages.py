"""The shared-memory ring with one writer and one reader, in process: round trips of random
sizes, wrap-around, parts written back to back, zero-copy views released on advance, the
oversize refusal, and diverted messages keeping their place in order.

No torch: these run in the torch-free venv too.
"""

from __future__ import annotations

import os
import random
import tempfile

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.ipc.shm_ring import Diverted, MessageTooLarge, RingError, RingFull, RingReader, RingWriter
from tests.ipc.ring_helpers import check_stamped, stamped
from tests.ipc.ring_helpers import ring_base_dir as _base_dir


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
