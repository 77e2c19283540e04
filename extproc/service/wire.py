"""Decoding Envoy's gRPC messages so that no client byte can make them undecodable.

Envoy copies client headers (x-request-id, user-agent, x-conversation-id, ...) into protobuf
``string`` fields as they came; bytes that are not UTF-8 make protobuf's parser reject the
whole message (DecodeError): an ext_proc stream fails (Envoy fails open, the request goes
unrouted) and an access log message loses every entry of its batch. ``decode_tolerant``
parses as usual and only when that fails walks the wire format with the message's
descriptor, replacing invalid UTF-8 in string fields by U+FFFD, then parses again. The
normal path costs nothing extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

if TYPE_CHECKING:
    from extproc.service.metrics import Metrics

M = TypeVar("M", bound=Message)
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


def decode_tolerant(message_class: type[M], data: bytes, metrics: Metrics) -> M:
    """The message; strings with invalid UTF-8 repaired (counted: non_utf8_repaired); bytes
    that are no message at all give an empty one (counted: undecodable)."""
    try:
        return message_class.FromString(data)
    except DecodeError:
        pass
    try:
        repaired = message_class.FromString(_repair(message_class.DESCRIPTOR, data))
    except (DecodeError, ValueError, IndexError):
        metrics.errors["undecodable"] += 1
        return message_class()
    metrics.errors["non_utf8_repaired"] += 1
    return repaired


def _repair(descriptor: Descriptor, data: bytes) -> bytes:
    out = bytearray()
    position, end = 0, len(data)
    while position < end:
        field_start = position
        tag, position = _varint(data, position)
        kind = tag & 7
        if kind == _VARINT:
            _, position = _varint(data, position)
        elif kind == _FIXED64:
            position += 8
        elif kind == _FIXED32:
            position += 4
        elif kind == _LENGTH:
            size, value_start = _varint(data, position)
            position = value_start + size
        else:  # groups: not used by Envoy's APIs
            raise ValueError(f"unsupported wire type {kind}")
        if position > end:
            raise ValueError("truncated message")
        field = descriptor.fields_by_number.get(tag >> 3) if kind == _LENGTH else None
        if field is None or field.type not in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_MESSAGE):
            out += data[field_start:position]  # copied as it came
            continue
        value = data[value_start:position]
        if field.type == FieldDescriptor.TYPE_STRING:
            value = value.decode("utf-8", "replace").encode()
        else:
            value = _repair(field.message_type, value)
        out += _encode_varint(tag) + _encode_varint(len(value)) + value
    return bytes(out)


def _varint(data: bytes, position: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, position
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)
