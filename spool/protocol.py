"""The control socket's protocol, sans I/O: frames in, frames out (docs/protocol.md).

A frame is a 5-byte header and a CBOR payload (RFC 8949):

    offset 0  u32 big-endian  payload length L (at most the decoder's ``max_frame``)
    offset 4  u8              kind: 1 request, 2 reply, 3 error
    offset 5  L bytes         one CBOR data item, a map (below), nothing after it

A request is ``{"id": uint, "op": text, "args": map}``; its answer is a reply
``{"id": same, "result": any}`` or an error ``{"id": same, "error": text, "message":
text}``, where ``error`` names an exception of ``spool.errors``. Many requests may be in
flight on one connection and are answered in any order: the id says which is which. An
error with id 0 is about the connection itself (a frame that cannot be read); the sender
closes the connection after it.

This module does no I/O and keeps no state beyond a decoder's buffer, so the owner and the
client share it and the fuzz tests drive it directly. It never raises anything but
``ProtocolError`` on bad input.
"""

from __future__ import annotations

import enum
import io
import struct
from typing import Any, Final

import attrs
import cbor2

from spool.errors import ProtocolError

VERSION: Final = 1
# The longest one ``claim`` request waits; a client that wants longer asks again.
CLAIM_WAIT_MAX: Final = 60.0
HEADER: Final = struct.Struct(">IB")
# A frame carries at most one message (``max_message_size``, 50 MiB by default) and its
# envelope; the owner sets its decoder's limit from the spool's options.
DEFAULT_MAX_FRAME: Final = 64 * 1024 * 1024
ID_MAX: Final = 2**63 - 1


class FrameKind(enum.IntEnum):
    REQUEST = 1
    REPLY = 2
    ERROR = 3


@attrs.frozen
class Request:
    id: int
    op: str
    args: dict[str, Any]


@attrs.frozen
class Reply:
    id: int
    result: Any


@attrs.frozen
class ErrorReply:
    id: int
    error: str
    message: str


Message = Request | Reply | ErrorReply


def encode(message: Message) -> bytes:
    """One frame holding ``message``."""
    match message:
        case Request(id, op, args):
            kind, payload = FrameKind.REQUEST, {"id": id, "op": op, "args": args}
        case Reply(id, result):
            kind, payload = FrameKind.REPLY, {"id": id, "result": result}
        case ErrorReply(id, error, text):
            kind, payload = FrameKind.ERROR, {"id": id, "error": error, "message": text}
    body = cbor2.dumps(payload)
    return HEADER.pack(len(body), kind) + body


class Decoder:
    """Bytes of a stream in, whole messages out. After a ``ProtocolError`` the stream is
    out of step for good: answer with an error of id 0 and close the connection."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        """The messages ``data`` completes, in order. ``ProtocolError`` for a frame that is
        too long, of an unknown kind, or whose payload is not a well-formed message."""
        self._buffer += data
        out: list[Message] = []
        while len(self._buffer) >= HEADER.size:
            length, kind = HEADER.unpack_from(self._buffer)
            if length > self.max_frame:
                raise ProtocolError(f"frame of {length} bytes, over the limit of {self.max_frame}")
            if kind not in FrameKind._value2member_map_:
                raise ProtocolError(f"unknown frame kind {kind}")
            end = HEADER.size + length
            if len(self._buffer) < end:
                break
            payload = bytes(self._buffer[HEADER.size : end])
            del self._buffer[:end]
            out.append(_message(FrameKind(kind), payload))
        return out

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buffer)


def _message(kind: FrameKind, payload: bytes) -> Message:
    stream = io.BytesIO(payload)
    try:
        value = cbor2.CBORDecoder(stream).decode()
    except Exception as e:  # cbor2 raises several types on hostile input; all mean the same
        raise ProtocolError(f"payload is not one CBOR data item: {e}") from None
    if stream.tell() != len(payload):
        raise ProtocolError("bytes after the payload's CBOR data item")
    if not isinstance(value, dict):
        raise ProtocolError("payload is not a CBOR map")
    msg_id = value.get("id")
    if type(msg_id) is not int or not 0 <= msg_id <= ID_MAX:
        raise ProtocolError("id is not an unsigned integer of at most 63 bits")
    if kind is FrameKind.REQUEST:
        op, args = value.get("op"), value.get("args")
        if set(value) != {"id", "op", "args"} or type(op) is not str or type(args) is not dict:
            raise ProtocolError("a request is a map of id, op (text) and args (a map)")
        if msg_id == 0:
            raise ProtocolError("request id 0 is reserved for errors about the connection")
        if not all(type(k) is str for k in args):
            raise ProtocolError("argument names must be text")
        return Request(msg_id, op, args)
    if kind is FrameKind.REPLY:
        if set(value) != {"id", "result"}:
            raise ProtocolError("a reply is a map of id and result")
        return Reply(msg_id, value["result"])
    error, text = value.get("error"), value.get("message")
    if set(value) != {"id", "error", "message"} or type(error) is not str or type(text) is not str:
        raise ProtocolError("an error is a map of id, error (text) and message (text)")
    return ErrorReply(msg_id, error, text)
