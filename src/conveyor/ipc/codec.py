"""The one codec for internal messages: msgspec Structs <-> bytes (msgpack with raw arrays).

Wire shape of a message, one contiguous buffer::

    1 byte PROTOCOL_VERSION | msgpack array [tag, field1, field2, ...]

Every message is a :class:`~conveyor.ipc.messages.Message` (``array_like`` and tagged), so
msgspec packs and parses it in C, fields in declaration order; a nested struct (e.g.
SamplingParams) is an array of its fields. One :class:`msgspec.msgpack.Decoder` typed with
the union of all messages picks the class by the tag and checks every field's type against
the annotations as it parses. An array longer than its struct's fields is refused; a
shorter one is completed with the defaults of the missing trailing fields (msgspec's rule
for ``array_like`` structs).

Fields annotated :data:`~conveyor.ipc.messages.Int32Array` (token ids, block ids, the
per-request columns of a plan) do not travel as msgpack lists of ints: each is a msgpack
``ext`` of type :data:`INT32_EXT` holding its values as raw little-endian int32. Decoding
returns them as ``numpy`` arrays that are *views over the buffer given to* :func:`decode`
(unaligned, wherever the ext falls: ``tolist()`` of 256 costs 1.5 us against 1.1 us
aligned, measured; the codec as a whole is still faster): no per-element work, no copy. They are
valid as long as that buffer is: forever for a ZeroMQ frame or bytes (the array keeps it alive),
until the slot is released for a shared-memory ring (see :mod:`conveyor.ipc.step_channel`). A
receiver that keeps values beyond that copies them (``.tolist()``, ``np.array``); an empty one is a
shared read-only array. Encoding accepts a numpy array, an ``array.array('i')`` or any sequence of
ints for such a field (a list, the common case, is packed by :mod:`struct`): the message handed to
:func:`encode` is not changed; a struct whose Int32Array fields hold anything but numpy arrays is
encoded from a copy with those values packed.

Decoding validates everything it reads (version, tag known, arity, each field's type,
array sizes) and raises :class:`DecodeError` naming the problem with field names
(``StepPlan.cached_requests.slots: ...``); it never executes anything from the payload
(no pickle; the one ext type is read as bytes). Receivers turn a DecodeError into an error
reply or a log line, never a crash.
"""

from __future__ import annotations

import array
import operator
import re
import struct
import types
import typing
from collections.abc import Callable
from typing import Any, Union

import msgspec
import numpy as np

from conveyor.ipc.messages import MESSAGE_TYPES, PROTOCOL_VERSION, Int32Array, Message

MAX_MESSAGE_BYTES = 256 * 1024 * 1024

# msgpack ext type code of an Int32Array's raw bytes.
INT32_EXT = 1


class DecodeError(ValueError):
    """A payload that is not a valid message; the text says what is wrong."""


# ------------------------------------------------------------------------ arrays

_I32 = np.dtype("<i4")
_EMPTY = np.empty(0, _I32)  # every empty Int32Array decoded: shared, so read-only
_EMPTY.flags.writeable = False


def _int32_ext(value: Any) -> msgspec.msgpack.Ext:
    """The wire form of an Int32Array field's value; TypeError / OverflowError for values
    that are not a 1-D sequence of int32s."""
    kind = type(value)
    if kind is list or kind is tuple:  # what the scheduler and the worker build: first
        # struct converts ints about 3x cheaper than array.array, whose per-item
        # conversion parses a format string.
        try:
            data: Any = struct.pack(f"<{len(value)}i", *value)
        except struct.error:  # let array.array raise its OverflowError / TypeError
            data = memoryview(array.array("i", value)).cast("B")
    elif kind is np.ndarray and value.dtype == _I32 and value.ndim == 1 and value.flags.c_contiguous:
        data = value.data.cast("B")
    elif isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise TypeError(f"an Int32Array field takes a 1-D array, got shape {value.shape}")
        if value.dtype.kind not in "iu" and value.size:
            raise TypeError(f"an Int32Array field takes integers, got dtype {value.dtype}")
        cast = np.ascontiguousarray(value, dtype=_I32)
        if not np.array_equal(cast, value):
            raise OverflowError("value out of int32 range in an Int32Array field")
        data = cast.data.cast("B")
    elif kind is array.array and value.typecode == "i" and value.itemsize == 4:
        data = memoryview(value).cast("B")
    else:
        data = memoryview(array.array("i", value)).cast("B")  # any sequence of ints; OverflowError beyond int32
    return msgspec.msgpack.Ext(INT32_EXT, data)


def _ext_problem(code: int, nbytes: int) -> str | None:
    """What is wrong with an ext of ``nbytes`` bytes of type ``code`` as an Int32Array."""
    if code != INT32_EXT:
        return f"unknown msgpack ext type {code}"
    if nbytes % 4:
        return f"int32 array of {nbytes} bytes is not a whole number of int32s"
    return None


class MalformedArray:
    """What the decoder reads for a malformed ext: no Int32Array field accepts it, so
    msgspec refuses it with the path of the field (:func:`_named` says what was wrong)."""


_MALFORMED = MalformedArray()


def _int32_view(code: int, data: memoryview) -> Any:
    """ext_hook of the decoder: an INT32_EXT as an int32 view over the received buffer."""
    if not data and code == INT32_EXT:
        return _EMPTY  # (most plans drop no slot: skip the numpy call)
    if _ext_problem(code, len(data)):
        return _MALFORMED
    return np.frombuffer(data, _I32)


# ------------------------------------------------------------- array packing

# Int32Array values that are numpy arrays (what the scheduler's plan columns and decoded
# messages hold) reach the encoder's enc_hook as they are. Any other value (a list) must be
# turned into its ext before msgspec sees it, or it would travel as msgpack ints: a packer
# returns its struct with those values replaced, in a copy, or the struct itself when none
# of its Int32Array fields, at any depth, needs it (the common plan: no copy at all).
Packer = Callable[[Any], Any]
_PACKERS: dict[type, Packer | None] = {}  # None: the class holds no Int32Array


def _packer_of(cls: type) -> Packer | None:
    if cls in _PACKERS:
        return _PACKERS[cls]
    _PACKERS[cls] = None  # (a class holding itself, indirectly, adds nothing)
    arrays: list[str] = []
    nested: list[tuple[str, Packer]] = []
    listed: list[tuple[str, Packer]] = []
    for f in msgspec.structs.fields(cls):
        if f.type is Int32Array:
            arrays.append(f.name)
        elif _is_struct(f.type) and (inner := _packer_of(f.type)) is not None:
            nested.append((f.name, inner))
        elif typing.get_origin(f.type) is list and _is_struct(item := typing.get_args(f.type)[0]):
            if (inner := _packer_of(item)) is not None:
                listed.append((f.name, inner))
    if not (arrays or nested or listed):
        return None
    replace = msgspec.structs.replace

    def pack(obj: Any) -> Any:
        changes = {}
        for name in arrays:
            value = getattr(obj, name)
            if type(value) is not np.ndarray:
                changes[name] = _int32_ext(value)
        for name, inner in nested:
            value = getattr(obj, name)
            packed = inner(value)
            if packed is not value:
                changes[name] = packed
        for name, inner in listed:
            items = getattr(obj, name)
            packed_items = [inner(item) for item in items]
            if any(map(operator.is_not, packed_items, items)):
                changes[name] = packed_items
        return replace(obj, **changes) if changes else obj

    _PACKERS[cls] = pack
    return pack


def _is_struct(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, msgspec.Struct)


def _enc_hook(value: Any) -> Any:
    """The encoder's hook for types msgpack lacks: numpy arrays, in Int32Array fields only
    (the packers leave no other value there; an array elsewhere is refused)."""
    if isinstance(value, np.ndarray):
        return _int32_ext(value)
    raise TypeError(f"cannot encode a {type(value).__name__} in a message")


# ---------------------------------------------------------------------- messages

_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
# UP007 (use X | Y) does not apply: this union is built from a tuple at run time.
_decoder = msgspec.msgpack.Decoder(Union[tuple(MESSAGE_TYPES.values())], ext_hook=_int32_view)  # type: ignore[misc]  # noqa: UP007
_VERSION = bytes([PROTOCOL_VERSION])
_MESSAGE_PACKERS = {cls: _packer_of(cls) for cls in MESSAGE_TYPES.values()}


def encode(msg: Message) -> bytes:
    """Serialize a registered message into one buffer. Raises TypeError for anything else
    (OverflowError for an Int32Array value beyond int32)."""
    try:
        pack = _MESSAGE_PACKERS[type(msg)]
    except KeyError:
        raise TypeError(f"{type(msg).__name__} is not a registered message") from None
    return _VERSION + _encoder.encode(msg if pack is None else pack(msg))


def encode_parts(msg: Message) -> list[bytes]:
    """:func:`encode` as the list of buffers to write back to back (what a ring slot takes)."""
    return [encode(msg)]


def decode(data: bytes | memoryview) -> Message:
    """Parse and validate one message; raises DecodeError on anything malformed.

    Int32Array fields come back as numpy views over ``data`` (see the module docstring).
    """
    size = len(data)
    if size > MAX_MESSAGE_BYTES:
        raise DecodeError(f"message of {size} bytes exceeds {MAX_MESSAGE_BYTES}")
    if not size:
        raise DecodeError("empty message: no protocol version byte")
    if data[0] != PROTOCOL_VERSION:
        raise DecodeError(f"protocol version {data[0]} unsupported (expected {PROTOCOL_VERSION})")
    body = memoryview(data)[1:]
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise DecodeError(_named(str(exc), body)) from None
    except msgspec.DecodeError as exc:
        raise DecodeError(f"malformed msgpack: {exc}") from None


# ------------------------------------------------------ naming a validation error

_AT = re.compile(r"^(.*?) - at (`key` in )?`\$(.*)`$", re.S)
_INDEX = re.compile(r"\[(\d+|\.\.\.)\]")


def _named(text: str, body: memoryview) -> str:
    """msgspec's ``Expected `str`, got `int` - at `$[1][0]``` with the array indices
    turned into the names of the fields they are (``AbortRequests.request_ids[0]: expected
    str, got int``). Only on errors: it parses the payload again, untyped."""
    found = _AT.match(text)
    what, key, indices = (found[1], found[2], _INDEX.findall(found[3])) if found else (text, None, None)
    what = what.replace("`", "").replace("numpy.ndarray", "int32 array")  # (an Int32Array field)
    what = what[:1].lower() + what[1:]
    try:
        raw = msgspec.msgpack.decode(body, ext_hook=msgspec.msgpack.Ext)
    except msgspec.DecodeError:
        raw = None
    if type(raw) is not list:
        return f"message must be an array [tag, fields...]: {what}"
    tag = raw[0] if raw else None
    if type(tag) is not int or tag not in MESSAGE_TYPES:
        return f"unknown message tag {tag!r}"
    value = raw
    for index in indices or []:
        value = value[int(index)] if index.isdigit() and type(value) is list and int(index) < len(value) else None
    if type(value) is msgspec.msgpack.Ext:
        what = _ext_problem(value.code, len(value.data)) or what
    where = _field_path(MESSAGE_TYPES[tag], indices or [])
    return f"{where}{' key' if key else ''}: {what}"


def _field_path(hint: Any, indices: list[str]) -> str:
    """``Class.field.field[3].field`` for the array indices of a path through ``hint``."""
    name = hint.__name__
    for index in indices:
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) in (Union, types.UnionType) and len(options) == 1:
            hint = options[0]  # an optional value
        if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
            fields = msgspec.structs.fields(hint)
            position = int(index) - (hint.__struct_config__.tag is not None) if index.isdigit() else -2
            if position == -1:
                name, hint = f"{name} tag", None
            elif 0 <= position < len(fields):
                name, hint = f"{name}.{fields[position].name}", fields[position].type
            else:
                name, hint = f"{name}[{index}]", None
        elif typing.get_origin(hint) is list:
            name, hint = f"{name}[{index}]", typing.get_args(hint)[0]
        else:
            name, hint = f"{name}[{index}]", None
    return name
