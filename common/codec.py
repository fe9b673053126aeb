"""The one codec for internal messages: typed dataclasses <-> bytes (msgpack + raw arrays).

Wire shape of a message, one contiguous buffer::

    u32 little-endian H | H bytes of msgpack header | zero padding to 8 | array data

The header is a msgpack array ``[tag, version, field1, field2, ...]`` with fields in
dataclass order; a nested dataclass (e.g. SamplingParams) is an array of its fields.
Positional arrays keep plans small and decoding cheap.

Fields annotated :data:`~conveyor.common.messages.Int32Array` (token ids, block ids, the
per-request columns of a plan) do not travel as msgpack lists of ints: the header holds
``[offset, count]`` and the ``count`` little-endian int32 values lie in the array data at
``offset`` (from the start of the data section, 8-byte aligned). Decoding returns them as
read-only ``numpy`` arrays that are *views over the buffer given to* :func:`decode`: no
per-element work, no copy. They are valid as long as that buffer is: forever for a ZeroMQ
frame or bytes (the array keeps it alive), until the slot is released for a shared-memory
ring (see :mod:`conveyor.common.plan_channel`). A receiver that keeps values beyond that
copies them (``.tolist()``, ``np.array``). Encoding accepts a numpy array, an
``array.array('i')`` or any sequence of ints for such a field, and :func:`encode_parts`
hands the array buffers out uncopied, so a ring writes them straight into its slot.

Decoding validates everything it reads (tag known, version equal, arity, each field's
type against the dataclass annotations, array references inside the buffer) and raises
:class:`DecodeError` naming the problem; it never executes anything from the payload (no
pickle, no ext types). Receivers turn a DecodeError into an error reply or a log line,
never a crash.
"""

from __future__ import annotations

import array
import dataclasses
import struct
import threading
import types
import typing
from typing import Any, Callable

import msgpack
import numpy as np

from conveyor.common.messages import MESSAGE_TYPES, PROTOCOL_VERSION, Int32Array

MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class DecodeError(ValueError):
    """A payload that is not a valid message; the text says what is wrong."""


Validator = Callable[[Any, str], Any]


def _check_scalar(kind: type) -> Validator:
    def check(value: Any, where: str) -> Any:
        # bool is an int subclass: never accept it where an int or float is meant.
        if kind is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        elif isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            return value
        raise DecodeError(f"{where}: expected {kind.__name__}, got {type(value).__name__}")

    return check


def _check_any(value: Any, where: str) -> Any:
    return value


def _validator_for(hint: Any) -> Validator:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Int32Array:
        return _check_array
    if hint in _SCALARS:
        return _SCALARS[hint]
    if hint is type(None):

        def check_none(value: Any, where: str) -> Any:
            if value is not None:
                raise DecodeError(f"{where}: expected null, got {type(value).__name__}")
            return None

        return check_none
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        inner = _validator_for(options[0]) if len(options) == 1 else _union(options)
        nullable = type(None) in args

        def check_optional(value: Any, where: str) -> Any:
            if value is None and nullable:
                return None
            return inner(value, where)

        return check_optional
    if origin is list:
        item = _validator_for(args[0]) if args else _check_any

        def check_list(value: Any, where: str) -> Any:
            if not isinstance(value, list):
                raise DecodeError(f"{where}: expected array, got {type(value).__name__}")
            if item is _INT_CHECK:
                # Hot path (token ids, block ids): one pass, no per-item call.
                for v in value:
                    if type(v) is not int:
                        raise DecodeError(f"{where}: expected array of int, found {type(v).__name__}")
                return value
            if item is _STR_CHECK:
                # Hot path too: the request ids of a plan's running requests.
                for v in value:
                    if type(v) is not str:
                        raise DecodeError(f"{where}: expected str, found {type(v).__name__} in the array")
                return value
            return [item(v, f"{where}[{i}]") for i, v in enumerate(value)]

        return check_list
    if origin is dict:
        key_check = _validator_for(args[0]) if args else _check_any
        value_check = _validator_for(args[1]) if args else _check_any

        def check_dict(value: Any, where: str) -> Any:
            if not isinstance(value, dict):
                raise DecodeError(f"{where}: expected map, got {type(value).__name__}")
            return {key_check(k, f"{where} key"): value_check(v, f"{where}[{k!r}]") for k, v in value.items()}

        return check_dict
    if dataclasses.is_dataclass(hint):
        return _struct_decoder(hint)
    raise TypeError(f"codec cannot validate annotation {hint!r}")


def _union(options: list[Any]) -> Validator:
    checks = [_validator_for(o) for o in options]

    def check_union(value: Any, where: str) -> Any:
        for check in checks:
            try:
                return check(value, where)
            except DecodeError:
                continue
        raise DecodeError(f"{where}: unexpected {type(value).__name__}")

    return check_union


_SCALARS: dict[type, Validator] = {kind: _check_scalar(kind) for kind in (int, float, str, bool, bytes)}
_INT_CHECK = _SCALARS[int]
_STR_CHECK = _SCALARS[str]
_STRUCT_CACHE: dict[type, Validator] = {}


def _fields_of(cls: type) -> list[tuple[str, Validator]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, _validator_for(hints[f.name])) for f in dataclasses.fields(cls)]


def _struct_decoder(cls: type) -> Validator:
    if cls in _STRUCT_CACHE:
        return _STRUCT_CACHE[cls]

    def decode_struct(value: Any, where: str) -> Any:
        return _build(cls, fields, value, where)

    _STRUCT_CACHE[cls] = decode_struct
    fields = _fields_of(cls)
    return decode_struct


def _build(cls: type, fields: list[tuple[str, Validator]], value: Any, where: str) -> Any:
    if not isinstance(value, list):
        raise DecodeError(f"{where}: expected array for {cls.__name__}, got {type(value).__name__}")
    if len(value) != len(fields):
        raise DecodeError(f"{where}: {cls.__name__} has {len(fields)} fields, got {len(value)}")
    return cls(*[check(v, f"{where}.{name}") for (name, check), v in zip(fields, value)])


_MESSAGE_FIELDS: dict[int, list[tuple[str, Validator]]] = {}


def _message_fields(tag: int) -> list[tuple[str, Validator]]:
    fields = _MESSAGE_FIELDS.get(tag)
    if fields is None:
        fields = _MESSAGE_FIELDS[tag] = _fields_of(MESSAGE_TYPES[tag])
    return fields


# ------------------------------------------------------------------------ arrays

_I32 = np.dtype("<i4")
_PREFIX = struct.Struct("<I")
_ALIGN = 8
_ZEROS = bytes(_ALIGN)


class _Decoding(threading.local):
    """The buffer being decoded and where its array data starts (validators read it)."""

    buf: memoryview | None = None
    data_start: int = 0


_decoding = _Decoding()


def _check_array(value: Any, where: str) -> np.ndarray:
    if type(value) is not list or len(value) != 2 or type(value[0]) is not int or type(value[1]) is not int:
        raise DecodeError(f"{where}: expected an int32 array reference [offset, count], got {value!r:.60}")
    offset, count = value
    buf = _decoding.buf
    start = _decoding.data_start + offset
    if buf is None or offset < 0 or count < 0 or offset % 4 or start + 4 * count > len(buf):
        raise DecodeError(f"{where}: int32 array [{offset}, {count}] lies outside the message")
    return np.frombuffer(buf, _I32, count, start)


class _Arrays:
    """Array buffers of a message being encoded, in the order they follow the header."""

    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: list[Any] = []
        self.size = 0

    def add(self, value: Any) -> list[int]:
        if isinstance(value, np.ndarray):
            if value.ndim != 1:
                raise TypeError(f"an Int32Array field takes a 1-D array, got shape {value.shape}")
            if value.dtype != _I32:
                if value.dtype.kind not in "iu" and value.size:
                    raise TypeError(f"an Int32Array field takes integers, got dtype {value.dtype}")
                cast = value.astype(_I32)
                if not np.array_equal(cast, value):
                    raise OverflowError("value out of int32 range in an Int32Array field")
                value = cast
            data = np.ascontiguousarray(value).data
        elif isinstance(value, array.array) and value.typecode == "i" and value.itemsize == 4:
            data = memoryview(value)
        else:
            data = memoryview(array.array("i", value))  # any sequence of ints; OverflowError beyond int32
        offset, nbytes = self.size, data.nbytes
        if nbytes:
            self.parts.append(data.cast("B"))
            pad = -nbytes % _ALIGN
            if pad:
                self.parts.append(_ZEROS[:pad])
            self.size += nbytes + pad
        return [offset, nbytes // 4]


# ---------------------------------------------------------------------- encoding

Encoder = Callable[[Any, _Arrays], Any]


def _plain(value: Any, arrays: _Arrays) -> Any:
    return value


def _encoder_for(hint: Any) -> Encoder:
    """What a field of this annotation becomes in the header (msgpack packs the rest as is)."""
    if hint is Int32Array:
        return _array_field
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [_encoder_for(a) for a in args if a is not type(None)]
        if all(e is _plain for e in inner):
            return _plain
        if len(inner) != 1:
            raise TypeError(f"codec cannot encode a union of structured types {hint!r}")
        only = inner[0]
        return lambda value, arrays: None if value is None else only(value, arrays)
    if origin is list and args:
        item = _encoder_for(args[0])
        if item is _plain:
            return _list_of_plain
        return lambda value, arrays: [item(v, arrays) for v in value]
    if dataclasses.is_dataclass(hint):
        return _struct_encoder(hint)
    return _plain


def _list_of_plain(value: Any, arrays: _Arrays) -> Any:
    return value if type(value) is list else list(value)


def _array_field(value: Any, arrays: _Arrays) -> list[int]:
    return arrays.add(value)


_STRUCT_ENCODERS: dict[type, Callable[[Any, _Arrays], list]] = {}


def _struct_encoder(cls: type) -> Callable[[Any, _Arrays], list]:
    if cls in _STRUCT_ENCODERS:
        return _STRUCT_ENCODERS[cls]
    fields: list[tuple[str, Encoder]] = []

    def encode_struct(obj: Any, arrays: _Arrays) -> list:
        return [
            getattr(obj, name) if enc is _plain else enc(getattr(obj, name), arrays) for name, enc in fields
        ]

    _STRUCT_ENCODERS[cls] = encode_struct  # before the fields: a struct may (indirectly) hold itself
    hints = typing.get_type_hints(cls)
    fields.extend((f.name, _encoder_for(hints[f.name])) for f in dataclasses.fields(cls))
    return encode_struct


def encode_parts(msg: Any) -> list[Any]:
    """Serialize a registered message into buffers to be written back to back (the array
    parts are the caller's own memory, uncopied). Raises TypeError for anything else."""
    tag = getattr(type(msg), "TAG", None)
    if tag is None or MESSAGE_TYPES.get(tag) is not type(msg):
        raise TypeError(f"{type(msg).__name__} is not a registered message")
    arrays = _Arrays()
    header = msgpack.packb([tag, PROTOCOL_VERSION, *_struct_encoder(type(msg))(msg, arrays)], use_bin_type=True)
    head = _PREFIX.pack(len(header)) + header
    pad = -len(head) % _ALIGN
    if pad:
        head += _ZEROS[:pad]
    return [head, *arrays.parts] if arrays.parts else [head]


def encode(msg: Any) -> bytes:
    """Serialize a registered message into one buffer. Raises TypeError for anything else."""
    parts = encode_parts(msg)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def decode(data: bytes | memoryview) -> Any:
    """Parse and validate one message; raises DecodeError on anything malformed.

    Int32Array fields come back as numpy views over ``data`` (see the module docstring).
    """
    if len(data) > MAX_MESSAGE_BYTES:
        raise DecodeError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    if len(data) < _PREFIX.size:
        raise DecodeError(f"message of {len(data)} bytes is shorter than its length prefix")
    (header_len,) = _PREFIX.unpack_from(data)
    header_end = _PREFIX.size + header_len
    if header_end > len(data):
        raise DecodeError(f"header of {header_len} bytes overruns the {len(data)}-byte message")
    view = data if isinstance(data, memoryview) else memoryview(data)
    try:
        raw = msgpack.unpackb(view[_PREFIX.size : header_end], raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(f"malformed msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2:
        raise DecodeError("message must be an array [tag, version, fields...]")
    tag, version = raw[0], raw[1]
    if type(tag) is not int or tag not in MESSAGE_TYPES:
        raise DecodeError(f"unknown message tag {tag!r}")
    if version != PROTOCOL_VERSION:
        raise DecodeError(f"protocol version {version!r} unsupported (expected {PROTOCOL_VERSION})")
    cls = MESSAGE_TYPES[tag]
    _decoding.buf, _decoding.data_start = view, header_end + (-header_end % _ALIGN)
    try:
        return _build(cls, _message_fields(tag), raw[2:], cls.__name__)
    finally:
        _decoding.buf = None
