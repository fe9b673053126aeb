"""The one codec for internal messages: typed dataclasses <-> bytes (msgpack + raw arrays).

Wire shape of a message, one contiguous buffer::

    u32 little-endian H | H bytes of msgpack header | zero padding to 8 | array data

The header is a msgpack array ``[tag, version, field1, field2, ...]`` with fields in
dataclass order; a nested dataclass (e.g. SamplingParams) is an array of its fields.
Positional arrays keep plans small and decoding cheap.

Fields annotated :data:`~conveyor.ipc.messages.Int32Array` (token ids, block ids, the
per-request columns of a plan) do not travel as msgpack lists of ints: the header holds
``[offset, count]`` and the ``count`` little-endian int32 values lie in the array data at
``offset`` (from the start of the data section, 8-byte aligned). Decoding returns them as
``numpy`` arrays that are *views over the buffer given to* :func:`decode`: no per-element
work, no copy. They are valid as long as that buffer is: forever for a ZeroMQ frame or
bytes (the array keeps it alive), until the slot is released for a shared-memory ring (see
:mod:`conveyor.ipc.step_channel`). A receiver that keeps values beyond that copies them
(``.tolist()``, ``np.array``); an empty one is a shared read-only array. Encoding accepts a
numpy array, an ``array.array('i')`` or any sequence of ints for such a field (a list, the
common case, is packed by :mod:`struct`), and :func:`encode_parts` hands the array buffers
out uncopied, so a ring writes them straight into its slot.

Decoding validates everything it reads (tag known, version equal, arity, each field's
type against the dataclass annotations, array references inside the buffer) and raises
:class:`DecodeError` naming the problem; it never executes anything from the payload (no
pickle, no ext types). Receivers turn a DecodeError into an error reply or a log line,
never a crash.

Speed: a plan crosses the hot hop every step, so each message class gets an encoder and a
decoder *generated* from its annotations when first used: straight-line code with the type
checks inlined, instead of a walk over per-field validator closures (about 3x faster on a
step plan). Annotations without a fast form (maps, unions, nested lists) use the general
validators below. Error messages name the offending field (``StepPlan.cached_requests.
slots``); the path is only formatted when an error is raised.
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

from conveyor.ipc.messages import MESSAGE_TYPES, PROTOCOL_VERSION, Int32Array

MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class DecodeError(ValueError):
    """A payload that is not a valid message; the text says what is wrong."""


# A validator's ``where`` names the value for error messages: a string, or (parent, field
# name or list index) pairs, formatted only when an error is raised.
Validator = Callable[[Any, Any], Any]


def _path(where: Any) -> str:
    if type(where) is str:
        return where
    parent, part = where
    base = _path(parent)
    return f"{base}[{part}]" if type(part) is int else f"{base}.{part}"


def _fail(where: Any, expected: str, value: Any) -> typing.NoReturn:
    raise DecodeError(f"{_path(where)}: expected {expected}, got {type(value).__name__}")


# ------------------------------------------------------------ general validators


def _check_scalar(kind: type) -> Validator:
    def check(value: Any, where: Any) -> Any:
        # bool is an int subclass: never accept it where an int or float is meant.
        if kind is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        elif isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            return value
        _fail(where, kind.__name__, value)

    return check


def _check_any(value: Any, where: Any) -> Any:
    return value


def _check_none(value: Any, where: Any) -> None:
    if value is not None:
        _fail(where, "null", value)


def _check_list_of(kinds: frozenset, name: str) -> Validator:
    """A list whose items are all of exactly these types (their types collected in C)."""

    def check(value: Any, where: Any) -> Any:
        if type(value) is not list:
            _fail(where, "array", value)
        if value and not kinds.issuperset(map(type, value)):
            bad = next(v for v in value if type(v) not in kinds)
            raise DecodeError(f"{_path(where)}: expected array of {name}, found {type(bad).__name__}")
        return value

    return check


def _validator_for(hint: Any) -> Validator:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Int32Array:
        return _check_array
    if hint in _SCALARS:
        return _SCALARS[hint]
    if hint is type(None):
        return _check_none
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        inner = _validator_for(options[0]) if len(options) == 1 else _union(options)
        nullable = type(None) in args

        def check_optional(value: Any, where: Any) -> Any:
            if value is None and nullable:
                return None
            return inner(value, where)

        return check_optional
    if origin is list:
        if args and args[0] in (int, str):
            return _check_list_of(frozenset({args[0]}), args[0].__name__)
        item = _validator_for(args[0]) if args else _check_any

        def check_list(value: Any, where: Any) -> Any:
            if type(value) is not list:
                _fail(where, "array", value)
            return [item(v, (where, i)) for i, v in enumerate(value)]

        return check_list
    if origin is dict:
        key_check = _validator_for(args[0]) if args else _check_any
        value_check = _validator_for(args[1]) if args else _check_any

        def check_dict(value: Any, where: Any) -> Any:
            if not isinstance(value, dict):
                _fail(where, "map", value)
            return {key_check(k, f"{_path(where)} key"): value_check(v, f"{_path(where)}[{k!r}]") for k, v in value.items()}

        return check_dict
    if dataclasses.is_dataclass(hint):
        return _struct_decoder(hint)
    raise TypeError(f"codec cannot validate annotation {hint!r}")


def _union(options: list[Any]) -> Validator:
    checks = [_validator_for(o) for o in options]

    def check_union(value: Any, where: Any) -> Any:
        for check in checks:
            try:
                return check(value, where)
            except DecodeError:
                continue
        raise DecodeError(f"{_path(where)}: unexpected {type(value).__name__}")

    return check_union


_SCALARS: dict[type, Validator] = {kind: _check_scalar(kind) for kind in (int, float, str, bool, bytes)}

# ------------------------------------------------------------------------ arrays

_I32 = np.dtype("<i4")
_PREFIX = struct.Struct("<I")
_ALIGN = 8
_ZEROS = bytes(_ALIGN)
_EMPTY = np.empty(0, _I32)  # every empty Int32Array decoded: shared, so read-only
_EMPTY.flags.writeable = False


class _Decoding(threading.local):
    """The buffer being decoded and where its array data starts (validators read it)."""

    buf: memoryview | None = None
    data_start: int = 0


_decoding = _Decoding()


def _check_array(value: Any, where: Any) -> np.ndarray:
    if type(value) is not list or len(value) != 2 or type(value[0]) is not int or type(value[1]) is not int:
        raise DecodeError(f"{_path(where)}: expected an int32 array reference [offset, count], got {value!r:.60}")
    offset, count = value
    buf = _decoding.buf
    start = _decoding.data_start + offset
    if buf is None or offset < 0 or count < 0 or offset % 4 or start + 4 * count > len(buf):
        raise DecodeError(f"{_path(where)}: int32 array [{offset}, {count}] lies outside the message")
    if not count:
        return _EMPTY  # (most plans drop no slot: skip the numpy call)
    return np.frombuffer(buf, _I32, count, start)


class _Arrays:
    """Array buffers of a message being encoded, in the order they follow the header."""

    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: list[Any] = []
        self.size = 0

    def add(self, value: Any) -> list[int]:
        kind = type(value)
        if kind is list or kind is tuple:  # what the scheduler and the worker build: first
            if not value:
                return [self.size, 0]
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
        offset, nbytes = self.size, len(data)  # bytes, or a flat byte view: len() is nbytes
        if nbytes:
            self.parts.append(data)
            pad = -nbytes % _ALIGN
            if pad:
                self.parts.append(_ZEROS[:pad])
            self.size += nbytes + pad
        return [offset, nbytes // 4]


# ------------------------------------------------------- generated struct codecs

_STRUCT_DECODERS: dict[type, Validator] = {}
_STRUCT_ENCODERS: dict[type, Callable[[Any, _Arrays], list]] = {}


def _fields_of(cls: type) -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]


def _optional_of(hint: Any) -> Any | None:
    """X for ``X | None`` (one option besides None), else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        options = [a for a in args if a is not type(None)]
        if len(options) == 1 and len(args) == 2:
            return options[0]
    return None


def _decode_lines(var: str, hint: Any, where: str, env: dict[str, Any]) -> list[str]:
    """Statements that check ``var`` against ``hint`` (rebinding it to the decoded value)."""
    name = f"_v{len(env)}"
    if hint is int:
        return [f"if type({var}) is not int: _fail({where}, 'int', {var})"]
    if hint in (str, bytes, bool):
        return [f"if type({var}) is not {hint.__name__}: _fail({where}, {hint.__name__!r}, {var})"]
    if hint is float:
        return [
            f"if type({var}) is not float:",
            f"    if type({var}) is not int: _fail({where}, 'float', {var})",
            f"    {var} = float({var})",
        ]
    if hint is Int32Array:
        return [f"{var} = _check_array({var}, {where})"]
    inner = _optional_of(hint)
    if inner is not None:
        body = _decode_lines(var, inner, where, env)
        return [f"if {var} is not None:", *("    " + line for line in body)]
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint) or (Any,)
        if dataclasses.is_dataclass(item):
            env[name] = _struct_decoder(item)
            return [
                f"if type({var}) is not list: _fail({where}, 'array', {var})",
                f"{var} = [{name}(x, ({where}, i)) for i, x in enumerate({var})]",
            ]
    if dataclasses.is_dataclass(hint):
        env[name] = _struct_decoder(hint)
        return [f"{var} = {name}({var}, {where})"]
    env[name] = _validator_for(hint)
    return [f"{var} = {name}({var}, {where})"]


def _struct_decoder(cls: type) -> Validator:
    if cls in _STRUCT_DECODERS:
        return _STRUCT_DECODERS[cls]
    fields = _fields_of(cls)
    env: dict[str, Any] = {"_cls": cls, "_fail": _fail, "_check_array": _check_array, "DecodeError": DecodeError}
    n = len(fields)
    names = [f"f{i}" for i in range(n)]
    lines = [
        "def decode(value, where):",
        "    if type(value) is not list:",
        f"        raise DecodeError(f'{{_path(where)}}: expected array for {cls.__name__}, got {{type(value).__name__}}')",
        f"    if len(value) != {n}:",
        f"        raise DecodeError(f'{{_path(where)}}: {cls.__name__} has {n} fields, got {{len(value)}}')",
    ]
    env["_path"] = _path
    if n:
        lines.append(f"    {', '.join(names)}{',' if n == 1 else ''} = value")
    for var, (fname, hint) in zip(names, fields):
        lines += ["    " + line for line in _decode_lines(var, hint, f"(where, {fname!r})", env)]
    lines.append(f"    return _cls({', '.join(names)})")
    exec("\n".join(lines), env)  # noqa: S102 - source built above from the class's own annotations
    decode = _STRUCT_DECODERS[cls] = env["decode"]
    return decode


def _encode_expr(expr: str, hint: Any, env: dict[str, Any]) -> str | None:
    """An expression for the wire form of ``expr`` of this annotation; None: it goes as is."""
    name = f"_e{len(env)}"
    if hint is Int32Array:
        return f"arrays.add({expr})"
    inner = _optional_of(hint)
    if inner is not None:
        wire = _encode_expr("x", inner, env)
        if wire is None:
            return None
        name = f"_e{len(env)}"  # after the inner expression took its own names
        env[name] = eval(f"lambda x, arrays: None if x is None else {wire}", env)  # noqa: S307 - built here
        return f"{name}({expr}, arrays)"
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint) or (Any,)
        if dataclasses.is_dataclass(item):
            env[name] = _struct_encoder(item)
            return f"[{name}(x, arrays) for x in {expr}]"
        return None  # lists of scalars or lists: msgpack packs them (and tuples) as they are
    if dataclasses.is_dataclass(hint):
        env[name] = _struct_encoder(hint)
        return f"{name}({expr}, arrays)"
    return None


def _struct_encoder(cls: type) -> Callable[[Any, _Arrays], list]:
    if cls in _STRUCT_ENCODERS:
        return _STRUCT_ENCODERS[cls]
    env: dict[str, Any] = {}
    items = []
    for fname, hint in _fields_of(cls):
        expr = f"obj.{fname}"
        items.append(_encode_expr(expr, hint, env) or expr)
    exec(f"def encode(obj, arrays):\n    return [{', '.join(items)}]", env)  # noqa: S102 - built above
    encode = _STRUCT_ENCODERS[cls] = env["encode"]
    return encode


# ---------------------------------------------------------------------- messages


def encode_parts(msg: Any) -> list[Any]:
    """Serialize a registered message into buffers to be written back to back (the array
    parts are the caller's own memory, uncopied). Raises TypeError for anything else."""
    cls = type(msg)
    tag = getattr(cls, "TAG", None)
    if tag is None or MESSAGE_TYPES.get(tag) is not cls:
        raise TypeError(f"{cls.__name__} is not a registered message")
    arrays = _Arrays()
    fields = (_STRUCT_ENCODERS.get(cls) or _struct_encoder(cls))(msg, arrays)
    header = msgpack.packb([tag, PROTOCOL_VERSION, *fields], use_bin_type=True)
    pad = -(_PREFIX.size + len(header)) % _ALIGN
    head = _PREFIX.pack(len(header)) + header + _ZEROS[:pad]
    return [head, *arrays.parts] if arrays.parts else [head]


def encode(msg: Any) -> bytes:
    """Serialize a registered message into one buffer. Raises TypeError for anything else."""
    parts = encode_parts(msg)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def decode(data: bytes | memoryview) -> Any:
    """Parse and validate one message; raises DecodeError on anything malformed.

    Int32Array fields come back as numpy views over ``data`` (see the module docstring).
    """
    size = len(data)
    if size > MAX_MESSAGE_BYTES:
        raise DecodeError(f"message of {size} bytes exceeds {MAX_MESSAGE_BYTES}")
    if size < _PREFIX.size:
        raise DecodeError(f"message of {size} bytes is shorter than its length prefix")
    (header_len,) = _PREFIX.unpack_from(data)
    header_end = _PREFIX.size + header_len
    if header_end > size:
        raise DecodeError(f"header of {header_len} bytes overruns the {size}-byte message")
    view = data if type(data) is memoryview else memoryview(data)
    try:
        raw = msgpack.unpackb(view[_PREFIX.size : header_end], raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(f"malformed msgpack: {exc}") from None
    if type(raw) is not list or len(raw) < 2:
        raise DecodeError("message must be an array [tag, version, fields...]")
    tag, version = raw[0], raw[1]
    if type(tag) is not int or tag not in MESSAGE_TYPES:
        raise DecodeError(f"unknown message tag {tag!r}")
    if version != PROTOCOL_VERSION:
        raise DecodeError(f"protocol version {version!r} unsupported (expected {PROTOCOL_VERSION})")
    cls = MESSAGE_TYPES[tag]
    decoding = _decoding
    decoding.buf, decoding.data_start = view, header_end + (-header_end % _ALIGN)
    try:
        return (_STRUCT_DECODERS.get(cls) or _struct_decoder(cls))(raw[2:], cls.__name__)
    finally:
        decoding.buf = None
