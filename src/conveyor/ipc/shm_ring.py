"""A one-writer, N-reader ring of fixed-size slots in shared memory, for hops on one host.

Each step's plan (scheduler -> worker) and result (back) is written once into shared memory
and read in place by every reader: no socket, no I/O thread, no copy on the read side;
:mod:`conveyor.ipc.step_channel` decides when to use it. Its segment, layout, back-pressure,
dead-peer detection, doorbells, memory ordering, oversize messages and clean-up are in
docs/architecture.md, "The shared-memory ring".
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import mmap
import os
import platform
import select
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger("conveyor.shm_ring")

Buffer = bytes | bytearray | memoryview

MAGIC = int.from_bytes(b"CNVYRING", "little")
VERSION = 3  # 1: N readers (.bellN), 2: one reader (.bell); 3: N readers again
DEFAULT_SLOT_BYTES = 256 * 1024
DEFAULT_NUM_SLOTS = 16
DEFAULT_SPIN_US = 20.0
DEFAULT_LIVENESS_INTERVAL_S = 0.05
MAX_READERS = 64

_LINE = 64
_WORDS_PER_LINE = _LINE // 8
_SLOT_HEADER = 32
# Header words.
_H_MAGIC, _H_VERSION, _H_SLOT_BYTES, _H_NUM_SLOTS, _H_NUM_READERS, _H_WRITER_PID, _H_WRITER_START, _H_CLOSED = range(8)
# Reader line words.
_R_STATE, _R_PID, _R_START, _R_CURSOR, _R_WAITING = range(5)
# Slot header words.
_S_SEQ, _S_LEN, _S_FLAGS = range(3)
_FLAG_DIVERTED = 1

# Reader states. PENDING readers (declared, not attached yet) hold messages like live ones.
PENDING, ATTACHED, DETACHED, DROPPED = 0, 1, 2, 3
_STATE_NAMES = {PENDING: "pending", ATTACHED: "attached", DETACHED: "detached", DROPPED: "dropped"}
_HOLDS_MESSAGES = (PENDING, ATTACHED)


class RingError(RuntimeError):
    """The ring cannot be used as asked (not a ring, slot taken, protocol violated)."""


class MessageTooLarge(ValueError):
    """The payload does not fit in one slot; nothing was published."""


class RingFull(TimeoutError):
    """The writer waited ``timeout`` for a reader to free a slot; nothing was published."""


class RingClosed(EOFError):
    """The writer closed the ring and every message before that has been read."""


class WriterDied(RingError):
    """The writer's process is gone and every message it published has been read."""


class ReaderDropped(RingError):
    """The writer declared this reader dead and may have reused its slots."""


@dataclass(frozen=True)
class Diverted:
    """In the place of message ``seq``: that payload went on the fallback channel.

    ``index`` counts the diverted messages before this one, so the reader can check it takes
    the matching one from the fallback channel.
    """

    seq: int
    index: int


@dataclass(frozen=True)
class ReaderStatus:
    index: int
    state: str  # pending, attached, detached, dropped
    pid: int
    position: int  # messages consumed


@dataclass(frozen=True)
class _Layout:
    slot_bytes: int
    num_slots: int
    num_readers: int

    @property
    def slots_offset(self) -> int:
        return _LINE * (1 + self.num_readers)

    @property
    def stride(self) -> int:
        return -(-(_SLOT_HEADER + self.slot_bytes) // _LINE) * _LINE

    @property
    def size(self) -> int:
        return self.slots_offset + self.stride * self.num_slots

    def reader_word(self, index: int, field: int) -> int:
        return (1 + index) * _WORDS_PER_LINE + field

    def slot_word(self, slot: int) -> int:
        return (self.slots_offset + slot * self.stride) // 8

    def payload_offset(self, slot: int) -> int:
        return self.slots_offset + slot * self.stride + _SLOT_HEADER


# ---------------------------------------------------------------------------- files


def bell_path(path: str, index: int) -> str:
    """The doorbell FIFO of reader ``index``."""
    return f"{path}.bell{index}"


def ring_path(run_dir: str, name: str) -> str:
    """Where a ring called ``name`` of the server using ``run_dir`` lives.

    In the run directory when it is on a memory filesystem (XDG_RUNTIME_DIR usually is); else
    in /dev/shm, named after the run directory so its owner can find and remove it.
    """
    if _on_memory_fs(run_dir) or not os.path.isdir("/dev/shm"):
        return os.path.join(run_dir, name)
    return os.path.join("/dev/shm", f"{os.path.basename(os.path.normpath(run_dir))}-{name}")


def _on_memory_fs(directory: str) -> bool:
    try:
        target = os.path.realpath(directory)
        best, fstype = "", ""
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mount_point = left.split()[4].replace("\\040", " ")
                inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, fstype = mount_point, right.split()[0]
        return fstype in ("tmpfs", "ramfs")
    except (OSError, IndexError):
        return False


def create_ring(
    path: str,
    *,
    slot_bytes: int = DEFAULT_SLOT_BYTES,
    num_slots: int = DEFAULT_NUM_SLOTS,
    num_readers: int = 1,
) -> None:
    """Create the ring file and its doorbells at ``path`` (which must not exist).

    The file appears complete or not at all (written under a temporary name, then linked),
    so an attacher racing the creator never sees half a header.
    """
    if not 8 <= slot_bytes <= 1 << 40:
        raise ValueError(f"slot_bytes must be at least 8 (a diversion marker), got {slot_bytes}")
    if num_slots < 1:
        raise ValueError(f"num_slots must be positive, got {num_slots}")
    if not 1 <= num_readers <= MAX_READERS:
        raise ValueError(f"num_readers must be 1..{MAX_READERS}, got {num_readers}")
    layout = _Layout(slot_bytes, num_slots, num_readers)
    if os.path.lexists(path):
        raise FileExistsError(errno.EEXIST, "ring already exists", path)
    made: list[str] = []
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        for i in range(num_readers):
            os.mkfifo(bell_path(path, i), 0o600)
            made.append(bell_path(path, i))
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        made.append(tmp)
        try:
            try:
                os.posix_fallocate(fd, 0, layout.size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, layout.size)
            header = [MAGIC, VERSION, slot_bytes, num_slots, num_readers, 0, 0, 0]
            os.pwrite(fd, b"".join(w.to_bytes(8, "little") for w in header), 0)
        finally:
            os.close(fd)
        os.link(tmp, path)  # fails instead of replacing a ring someone created meanwhile
        os.unlink(tmp)
    except BaseException:
        for p in made:
            _unlink_quietly(p)
        raise


def unlink_ring(path: str) -> None:
    """Remove the ring file and its doorbells; idempotent. Open mappings stay valid."""
    directory, base = os.path.split(path)
    prefix = base + ".bell"
    try:
        names = os.listdir(directory or ".")
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(prefix) and name[len(prefix) :].isdigit():
            _unlink_quietly(os.path.join(directory, name))
    _unlink_quietly(path)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------------------- liveness


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of ``pid`` from /proc, or None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()  # the name may hold spaces and parentheses
    return fields[0].decode(), int(fields[19])


def _start_time(pid: int) -> int:
    st = _proc_stat(pid)
    return st[1] if st else 0


def process_start_time(pid: int) -> int:
    """When ``pid`` started (clock ticks since boot; 0 if unknown): with the pid, names a process
    for :func:`pid_alive` even after the pid is reused."""
    return _start_time(pid)


def pid_alive(pid: int, start_time: int = 0) -> bool:
    """Whether ``pid`` is a running process (not a zombie) started at ``start_time`` (0: any)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    if not os.path.isdir("/proc/self"):
        return True  # no /proc: kill(0) is all we can know
    st = _proc_stat(pid)
    if st is None:
        return False
    state, started = st
    if state in ("Z", "X"):
        return False
    return not start_time or started == start_time


# ---------------------------------------------------------------------------- mapping


class _Mapping:
    """One process's mapping of a ring file, validated against its header."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            head = os.pread(self.fd, _LINE, 0)
            words = [int.from_bytes(head[i : i + 8], "little") for i in range(0, len(head), 8)]
            if len(words) < 8 or words[_H_MAGIC] != MAGIC:
                raise RingError(f"{path} is not a conveyor ring")
            if words[_H_VERSION] != VERSION:
                raise RingError(f"{path} has ring version {words[_H_VERSION]}, expected {VERSION}")
            self.layout = _Layout(words[_H_SLOT_BYTES], words[_H_NUM_SLOTS], words[_H_NUM_READERS])
            size = os.fstat(self.fd).st_size
            if size != self.layout.size:
                raise RingError(f"{path} is {size} bytes, its header says {self.layout.size}")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # fault the pages in now
            self.mm = mmap.mmap(self.fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.bytes = memoryview(self.mm)
        self.words = self.bytes.cast("q")

    def lock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self.words.release()
        self.bytes.release()
        try:
            self.mm.close()
        except BufferError:
            pass  # a caller still holds an object built on a payload view: unmapped when it goes
        os.close(self.fd)


# x86 keeps stores in order, loads in order, and loads before later stores (TSO): there only the
# doorbell handshake (a store, then a load of another word) needs a barrier. See the module doc.
_TSO = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


class _Barrier:
    """A full memory barrier: release then re-acquire a lock only this endpoint holds (see module doc).

    ``full()`` always; ``order()`` only where the hardware may reorder (not x86).
    """

    def __init__(self) -> None:
        lock = threading.Lock()
        lock.acquire()
        self.release, self.acquire = lock.release, lock.acquire

    def full(self) -> None:
        self.release()
        self.acquire()

    def order(self) -> None:
        if not _TSO:
            self.release()
            self.acquire()


def _finish_writer(m: _Mapping, bell_fds: list[int], unlink_path: str | None, pid: int) -> None:
    """Close the ring for its readers and release the writer's resources.

    Run once: by ``close``, or by the finalizer when the writer is collected or its process
    exits without closing (then readers see RingClosed, not WriterDied). Not in a forked
    child, whose copy of the writer never wrote anything.
    """
    if os.getpid() != pid:
        return
    barrier = _Barrier()
    barrier.order()  # every published message before the closed flag
    m.words[_H_CLOSED] = 1
    barrier.full()
    for fd in bell_fds:
        try:
            os.write(fd, b"\x01")
        except BlockingIOError:
            pass
        os.close(fd)
    m.close()
    if unlink_path is not None:
        unlink_ring(unlink_path)


def _finish_reader(m: _Mapping, state_word: int, waiting_word: int, bell: int, pid: int) -> None:
    """Detach the reader (the writer stops holding slots for it) and release its resources.

    Run once: by ``close``, or by the finalizer when the reader is collected or its process
    exits without closing, so a reader that is simply gone never holds the writer back.
    """
    if os.getpid() != pid:
        return
    words = m.words
    if words[state_word] == ATTACHED:
        words[state_word] = DETACHED
    words[waiting_word] = 0
    os.close(bell)
    m.close()


def _as_bytes(part: Buffer) -> memoryview:
    view = memoryview(part)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")  # raises for non-contiguous buffers
    return view


# ---------------------------------------------------------------------------- writer


class RingWriter:
    """The one writer of a ring. Use from one thread."""

    def __init__(
        self,
        path: str,
        *,
        spin_us: float = DEFAULT_SPIN_US,
        liveness_interval_s: float = DEFAULT_LIVENESS_INTERVAL_S,
        owner: bool = False,
    ) -> None:
        """Attach as the writer of the ring at ``path``; a ring has one writer in its life.

        ``owner``: this writer unlinks the ring when closed (or when the process exits).
        """
        self.path = path
        self._m = m = _Mapping(path)
        self._closed = False
        self._bell_fds: list[int] = []
        try:
            m.lock()
            try:
                pid = m.words[_H_WRITER_PID]
                if pid:
                    raise RingError(f"{path} already has a writer (pid {pid}); a ring has one writer in its life")
                if m.words[_H_CLOSED]:
                    raise RingError(f"{path} is closed")
                m.words[_H_WRITER_START] = _start_time(os.getpid())
                m.words[_H_WRITER_PID] = os.getpid()
            finally:
                m.unlock()
            layout = m.layout
            for i in range(layout.num_readers):
                self._bell_fds.append(os.open(bell_path(path, i), os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC))
        except BaseException:
            for fd in self._bell_fds:
                os.close(fd)
            m.close()
            raise
        self._words = m.words
        self._bytes = m.bytes
        self._n = layout.num_slots
        self.max_payload = layout.slot_bytes
        self._slot_words = [layout.slot_word(s) for s in range(self._n)]
        self._payload_offsets = [layout.payload_offset(s) for s in range(self._n)]
        self._state_words = [layout.reader_word(i, _R_STATE) for i in range(layout.num_readers)]
        self._cursor_words = [layout.reader_word(i, _R_CURSOR) for i in range(layout.num_readers)]
        self._waiting_words = [(i, layout.reader_word(i, _R_WAITING)) for i in range(layout.num_readers)]
        self._next = 0  # seq of the next message
        self._min_cursor = 0  # a lower bound on every live reader's cursor: refreshed only when needed
        self._diverted = 0
        self._spin_ns = int(spin_us * 1000)
        self._liveness_ns = int(liveness_interval_s * 1e9)
        self._next_liveness_check = 0
        self._barrier = _Barrier()
        unlink_path = path if owner else None
        self._finalizer = weakref.finalize(self, _finish_writer, m, self._bell_fds, unlink_path, os.getpid())

    @classmethod
    def create(
        cls,
        path: str,
        *,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        num_slots: int = DEFAULT_NUM_SLOTS,
        num_readers: int = 1,
        spin_us: float = DEFAULT_SPIN_US,
        liveness_interval_s: float = DEFAULT_LIVENESS_INTERVAL_S,
    ) -> RingWriter:
        """Create a ring at ``path`` and become its writer and owner (it unlinks the ring on close)."""
        create_ring(path, slot_bytes=slot_bytes, num_slots=num_slots, num_readers=num_readers)
        try:
            return cls(path, spin_us=spin_us, liveness_interval_s=liveness_interval_s, owner=True)
        except BaseException:
            unlink_ring(path)
            raise

    @property
    def position(self) -> int:
        """Messages published so far (the seq the next one gets)."""
        return self._next

    def send(
        self,
        data: Buffer | Sequence[Buffer],
        *,
        timeout: float | None = None,
        divert: Callable[[Buffer], object] | None = None,
    ) -> int:
        """Publish one message (a buffer, or buffers written back to back); returns its seq.

        Waits for a free slot up to ``timeout`` seconds (None: as long as a live reader holds
        one; 0: not at all), then raises RingFull. A payload over ``max_payload`` raises
        MessageTooLarge, unless ``divert`` is given: see the module doc on ordering.
        """
        if self._closed:
            raise RingError("send on a closed ring")
        if type(data) is bytes or isinstance(data, bytearray):
            parts: Sequence[memoryview | bytes | bytearray] = (data,)
            total = len(data)
        elif isinstance(data, memoryview):
            parts = (_as_bytes(data),)
            total = parts[0].nbytes
        else:
            parts = [_as_bytes(p) for p in data]
            total = sum(p.nbytes for p in parts)
        seq = self._next
        if total > self.max_payload and divert is None:
            raise MessageTooLarge(f"message of {total} bytes exceeds the ring's slot of {self.max_payload} bytes")
        if seq - self._min_cursor >= self._n:
            self._wait_for_slot(seq, timeout)
        slot = seq % self._n
        pos = self._payload_offsets[slot]
        buf = self._bytes
        flags = 0
        if total > self.max_payload:
            assert divert is not None
            divert(parts[0] if len(parts) == 1 else b"".join(parts))
            buf[pos : pos + 8] = self._diverted.to_bytes(8, "little")
            self._diverted += 1
            total, flags = 8, _FLAG_DIVERTED
        else:
            for p in parts:  # bytes, bytearray or a flat memoryview of bytes: len() is nbytes
                end = pos + len(p)
                buf[pos:end] = p
                pos = end
        words = self._words
        w = self._slot_words[slot]
        words[w + _S_LEN] = total
        words[w + _S_FLAGS] = flags
        barrier = self._barrier
        if not _TSO:
            barrier.release()
            barrier.acquire()
        words[w] = seq + 1  # publish
        self._next = seq + 1
        barrier.release()  # full barrier: the seq store before the waiting-flag loads
        barrier.acquire()
        for i, ww in self._waiting_words:
            if words[ww]:
                self._ring(i)
        return seq

    def _ring(self, index: int) -> None:
        try:
            os.write(self._bell_fds[index], b"\x01")
        except BlockingIOError:
            pass  # the FIFO is full: the reader has a wake-up pending already

    def _refresh_min_cursor(self) -> int:
        words = self._words
        low = self._next
        for sw, cw in zip(self._state_words, self._cursor_words):
            if words[sw] in _HOLDS_MESSAGES:
                cursor = words[cw]
                if cursor < low:
                    low = cursor
        self._barrier.order()  # the cursor loads before the payload stores that follow
        self._min_cursor = low
        return low

    def _wait_for_slot(self, seq: int, timeout: float | None) -> None:
        n = self._n
        now = time.monotonic_ns()
        deadline = None if timeout is None else now + int(timeout * 1e9)
        spin_until = now + self._spin_ns
        sleep_s = 20e-6
        while seq - self._refresh_min_cursor() >= n:
            now = time.monotonic_ns()
            if now >= self._next_liveness_check:  # also reached by callers that retry with timeout=0
                self._next_liveness_check = now + self._liveness_ns
                if self.check_readers():
                    continue
            if deadline is not None and now >= deadline:
                lagging = [r for r in self.readers() if r.state in ("pending", "attached") and seq - r.position >= n]
                raise RingFull(f"ring full for {timeout} s: message {seq} waits for {lagging}")
            if now < spin_until:
                continue
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 2, 1e-3)

    def check_readers(self) -> list[int]:
        """Drop every attached reader whose process is gone; returns the indices dropped now."""
        words, layout = self._words, self._m.layout
        dropped = []
        for i in range(layout.num_readers):
            if words[layout.reader_word(i, _R_STATE)] != ATTACHED:
                continue
            pid = words[layout.reader_word(i, _R_PID)]
            if not pid_alive(pid, words[layout.reader_word(i, _R_START)]):
                words[layout.reader_word(i, _R_STATE)] = DROPPED
                log.warning("ring %s: reader %d (pid %d) is gone; dropped", self.path, i, pid)
                dropped.append(i)
        return dropped

    def reader_status(self, index: int = 0) -> ReaderStatus:
        words, layout = self._words, self._m.layout
        return ReaderStatus(
            index=index,
            state=_STATE_NAMES.get(words[layout.reader_word(index, _R_STATE)], "?"),
            pid=words[layout.reader_word(index, _R_PID)],
            position=words[layout.reader_word(index, _R_CURSOR)],
        )

    def readers(self) -> list[ReaderStatus]:
        return [self.reader_status(i) for i in range(self._m.layout.num_readers)]

    def close(self) -> None:
        """Mark the ring closed, wake every reader, unmap; the owner also unlinks. Idempotent."""
        if self._closed:
            return
        self._closed = True
        del self._words, self._bytes
        self._finalizer()

    def unlink(self) -> None:
        """Remove the ring's names now (readers already attached keep working); idempotent."""
        unlink_ring(self.path)

    def __enter__(self) -> RingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------- reader


class RingReader:
    """Reader ``index`` of a ring: sees every message from the first, in order. Use from one thread."""

    def __init__(
        self,
        path: str,
        index: int = 0,
        *,
        spin_us: float = DEFAULT_SPIN_US,
        liveness_interval_s: float = DEFAULT_LIVENESS_INTERVAL_S,
    ) -> None:
        self.path = path
        self.index = index
        self._m = m = _Mapping(path)
        layout = m.layout
        self._closed = False
        try:
            if not 0 <= index < layout.num_readers:
                raise RingError(f"reader index {index} out of range: {path} has {layout.num_readers} readers")
            m.lock()
            try:
                state = m.words[layout.reader_word(index, _R_STATE)]
                if state != PENDING:
                    name = _STATE_NAMES.get(state, state)
                    raise RingError(f"reader {index} of {path} is {name}; each index attaches once")
                m.words[layout.reader_word(index, _R_START)] = _start_time(os.getpid())
                m.words[layout.reader_word(index, _R_PID)] = os.getpid()
                m.words[layout.reader_word(index, _R_STATE)] = ATTACHED
            finally:
                m.unlock()
            self._bell = os.open(bell_path(path, index), os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except BaseException:
            m.close()
            raise
        self._poll = select.poll()
        self._poll.register(self._bell, select.POLLIN)
        self._words = m.words
        self._bytes = m.bytes
        self._n = layout.num_slots
        self._slot_words = [layout.slot_word(s) for s in range(self._n)]
        self._payload_offsets = [layout.payload_offset(s) for s in range(self._n)]
        self._state_word = layout.reader_word(index, _R_STATE)
        self._cursor_word = layout.reader_word(index, _R_CURSOR)
        self._waiting_word = layout.reader_word(index, _R_WAITING)
        self._cursor = m.words[self._cursor_word]
        self._current: memoryview | Diverted | None = None
        self._spin_ns = int(spin_us * 1000)
        self._liveness_ns = int(liveness_interval_s * 1e9)
        self._barrier = _Barrier()
        self._finalizer = weakref.finalize(
            self, _finish_reader, m, self._state_word, self._waiting_word, self._bell, os.getpid()
        )

    @property
    def position(self) -> int:
        """Messages consumed so far (the seq of the next one)."""
        return self._cursor

    def fileno(self) -> int:
        """The doorbell fd, for the caller's own poller; it is rung only while ``arm``ed."""
        return self._bell

    def ready(self) -> bool:
        """Whether the next message is published (never blocks)."""
        return self._words[self._slot_words[self._cursor % self._n]] > self._cursor

    def arm(self) -> bool:
        """Drain the doorbell and ask to be rung on each publish; True if a message is already there.

        For waiting on the ring in the caller's poller: ``if not r.arm(): poll(...)``, then
        ``r.disarm()`` (or leave it armed: a ring per publish costs the writer a write()).
        """
        self._drain()
        self._words[self._waiting_word] = 1
        self._barrier.full()
        return self.ready()

    def disarm(self) -> None:
        self._words[self._waiting_word] = 0

    def view(self, timeout: float | None = None) -> memoryview | Diverted | None:
        """The next message without consuming it: a view over its payload, valid until ``advance``.

        Waits up to ``timeout`` seconds (None: until a message comes; 0: not at all) and
        returns None if none came. Raises RingClosed or WriterDied once the writer is closed
        or gone and everything has been read, ReaderDropped if this reader was dropped.
        """
        current = self._current
        if current is not None:
            return current
        if self._closed:
            raise RingError("view on a closed reader")
        c = self._cursor
        w = self._slot_words[c % self._n]
        words = self._words
        seq = words[w]
        if seq != c + 1 and not self._wait(c, w, seq, timeout):
            return None
        if not _TSO:
            self._barrier.order()  # the seq load before the payload loads
        length = words[w + _S_LEN]
        pos = self._payload_offsets[c % self._n]
        if words[w + _S_FLAGS] & _FLAG_DIVERTED:
            current = Diverted(c, int.from_bytes(self._bytes[pos : pos + 8], "little"))
        else:
            current = self._bytes[pos : pos + length]
        self._current = current
        return current

    def advance(self) -> None:
        """Consume the message ``view`` returned: release its view and free its slot."""
        current = self._current
        if current is None:
            raise RingError("advance() without a message from view()")
        if isinstance(current, memoryview):
            try:
                current.release()
            except BufferError:
                pass  # something built on the view holds it: the caller's promise not to use it
        self._current = None
        if not _TSO:
            self._barrier.order()  # every payload load before the store that frees the slot
        self._cursor += 1
        self._words[self._cursor_word] = self._cursor

    def recv(self, timeout: float | None = None) -> bytes | Diverted | None:
        """The next message, copied, and consumed; None on timeout. Same errors as ``view``."""
        current = self.view(timeout)
        if current is None or isinstance(current, Diverted):
            if current is not None:
                self.advance()
            return current
        data = bytes(current)
        if not _TSO:
            self._barrier.order()  # the copy's loads before the seq re-check
        if self._words[self._slot_words[self._cursor % self._n]] != self._cursor + 1:
            self._current = None
            raise ReaderDropped(f"reader {self.index}: message {self._cursor} was overwritten while being read")
        self.advance()
        return data

    def writer_alive(self) -> bool:
        """False once the writer's process is gone (True before any writer attached)."""
        pid = self._words[_H_WRITER_PID]
        return not pid or pid_alive(pid, self._words[_H_WRITER_START])

    def _check_slot(self, c: int, w: int, seq: int) -> bool:
        """True if message ``c`` is in its slot; raises if the slot holds a later one."""
        if seq == c + 1:
            return True
        if seq > c + 1:
            seq = self._words[w]  # re-read: an 8-byte load is whole, but be sure before failing
            if seq > c + 1:
                if self._words[self._state_word] == DROPPED:
                    raise ReaderDropped(f"reader {self.index} of {self.path} was dropped by the writer")
                raise RingError(f"reader {self.index}: slot holds message {seq - 1}, expected {c}")
            return seq == c + 1
        return False

    def _wait(self, c: int, w: int, seq: int, timeout: float | None) -> bool:
        words = self._words
        if self._check_slot(c, w, seq):
            return True
        if timeout is not None and timeout <= 0:
            self._check_ended(c, w)
            return False
        now = time.monotonic_ns()
        deadline = None if timeout is None else now + int(timeout * 1e9)
        spin_until = now + self._spin_ns if deadline is None else min(deadline, now + self._spin_ns)
        while now < spin_until:
            if words[w] > c:
                return self._check_slot(c, w, words[w])
            now = time.monotonic_ns()
        self._drain()
        words[self._waiting_word] = 1
        try:
            while True:
                self._barrier.full()  # the waiting-flag store before the seq load
                if self._check_slot(c, w, words[w]):
                    return True
                self._check_ended(c, w)
                now = time.monotonic_ns()
                if deadline is not None and now >= deadline:
                    return False
                wait_ns = self._liveness_ns if deadline is None else min(self._liveness_ns, deadline - now)
                if self._poll.poll(math.ceil(wait_ns / 1e6)):
                    self._drain()
                elif not self.writer_alive() and not self._check_slot(c, w, words[w]):
                    raise WriterDied(f"{self.path}: the writer (pid {words[_H_WRITER_PID]}) is gone")
        finally:
            words[self._waiting_word] = 0

    def _check_ended(self, c: int, w: int) -> None:
        """Raise if no message ``c`` can come: the ring is closed, or this reader was dropped."""
        words = self._words
        if words[_H_CLOSED]:
            self._barrier.order()  # the closed flag was stored after the last seq
            if not self._check_slot(c, w, words[w]):
                raise RingClosed(f"{self.path}: the writer closed the ring")
        if words[self._state_word] == DROPPED:
            raise ReaderDropped(f"reader {self.index} of {self.path} was dropped by the writer")

    def _drain(self) -> None:
        try:
            while os.read(self._bell, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Detach (the writer stops holding messages for this reader) and unmap; idempotent."""
        if self._closed:
            return
        self._closed = True
        current = self._current
        if isinstance(current, memoryview):
            try:
                current.release()
            except BufferError:
                pass
        self._current = None
        del self._words, self._bytes
        self._finalizer()

    def __enter__(self) -> RingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
