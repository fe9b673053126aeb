"""The frame every internal message shares: :class:`Message`, a ``msgspec.Struct`` that
travels as a positional msgpack array led by its stable integer tag (the class keyword
``tag=``), registered with :func:`message`; the structs nested in messages are
:class:`Positional`. Field order is the wire format: never reorder, only append fields with
defaults."""

from __future__ import annotations

from typing import ClassVar

import msgspec
import numpy as np

PROTOCOL_VERSION = 4  # 4: msgspec Structs, Int32Array as msgpack ext

# A 1-D int32 column (token ids, block ids, per-request counts). It travels as raw
# little-endian bytes (a msgpack ext) and arrives as a numpy view over the received buffer
# (see conveyor.ipc.codec). Senders may fill it with any sequence of ints; receivers must
# treat it as a numpy array, and copy what they keep.
Int32Array = np.ndarray


class Positional(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A struct nested in messages: encoded as the array of its fields, in order. Decoding
    refuses an array longer than the fields; a shorter one is completed by the defaults
    of the missing trailing fields (msgspec's rule for array_like structs)."""


class Message(Positional):
    """A wire message: a :class:`Positional` whose class keyword ``tag=`` (an int, part of
    the wire format: never reuse one) leads its array. Register it with :func:`message`."""

    TAG: ClassVar[int]


# tag -> class; filled by @message.
MESSAGE_TYPES: dict[int, type[Message]] = {}


def message(cls: type[Message]) -> type[Message]:
    """Class decorator registering a Message under its tag (also set as ``cls.TAG``)."""
    tag = cls.__struct_config__.tag
    if type(tag) is not int:
        raise TypeError(f"message {cls.__name__} needs an int tag=, got {tag!r}")
    if tag in MESSAGE_TYPES:
        raise ValueError(f"message tag {tag} already used by {MESSAGE_TYPES[tag].__name__}")
    cls.TAG = tag
    MESSAGE_TYPES[tag] = cls
    return cls
