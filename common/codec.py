"""The one codec for internal messages: typed dataclasses <-> msgpack bytes.

Wire shape of a message: a msgpack array ``[tag, version, field1, field2, ...]``
with fields in dataclass order; a nested dataclass (e.g. SamplingParams) is an
array of its fields. Positional arrays keep plans small and decoding cheap.

Decoding validates everything it reads (tag known, version equal, arity, each
field's type against the dataclass annotations) and raises :class:`DecodeError`
naming the problem; it never executes anything from the payload (no pickle,
no ext types). Receivers turn a DecodeError into an error reply or a log line,
never a crash.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Callable

import msgpack

from conveyor.common.messages import MESSAGE_TYPES, PROTOCOL_VERSION

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


def _to_wire(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [_to_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if isinstance(obj, list):
        if obj and type(obj[0]) in (int, str, float):
            return obj  # scalars: msgpack packs them as they are
        return [_to_wire(v) for v in obj]
    if isinstance(obj, tuple):
        return [_to_wire(v) for v in obj]
    return obj


def encode(msg: Any) -> bytes:
    """Serialize a registered message. Raises TypeError for anything else."""
    tag = getattr(type(msg), "TAG", None)
    if tag is None or MESSAGE_TYPES.get(tag) is not type(msg):
        raise TypeError(f"{type(msg).__name__} is not a registered message")
    return msgpack.packb([tag, PROTOCOL_VERSION, *_to_wire(msg)], use_bin_type=True)


def decode(data: bytes | memoryview) -> Any:
    """Parse and validate one message; raises DecodeError on anything malformed."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise DecodeError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
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
    return _build(cls, _message_fields(tag), raw[2:], cls.__name__)
