"""Reading a tensor stream (Init, Push) into the store: its header frame, then its body
into given byte targets. Wire errors become INVALID_ARGUMENT."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from ..proto import ps_pb2 as pb
from ..transport import wire
from .errors import invalid


def read_header(messages: Iterator[bytes], kind: int) -> pb.StreamHeader:
    first = next(messages, None)
    if first is None:
        raise invalid("the stream was empty; it must start with a header frame")
    try:
        header = wire.decode_frame(first)
    except wire.WireError as exc:
        raise invalid(str(exc)) from exc
    if not isinstance(header, pb.StreamHeader):
        raise invalid("the stream did not start with a header frame")
    if header.kind != kind:
        raise invalid(
            f"stream kind is {pb.StreamKind.Name(header.kind)}; this call expects "
            f"{pb.StreamKind.Name(kind)}"
        )
    return header


def read_body(header: pb.StreamHeader, messages: Iterator[bytes],
              targets: list[np.ndarray],
              on_data: Callable[[int, int], None] | None = None) -> None:
    try:
        reader = wire.StreamReader(header, targets)
        reader.on_data = on_data
        wire.read_body(reader, messages)
    except wire.WireError as exc:
        raise invalid(str(exc)) from exc
