"""Tensors on the wire: raw little-endian bytes in chunk frames, never pickles.

A tensor stream is a header frame (protobuf `StreamHeader`: names, dtypes, shapes,
total bytes) followed by chunk frames carrying consecutive slices of the concatenation
of those tensors' bytes. Chunk frames are protobuf `Frame` messages encoded by hand
with a fixed layout, so that

- the sender copies each byte once (tensor memory -> frame bytes), and
- the receiver copies each byte once (frame bytes -> destination tensor), with no
  protobuf copy of the payload on either side.

`StreamWriter` encodes, `StreamReader` decodes into caller-provided destination
tensors and rejects out-of-order, overlapping, oversized and truncated streams.
"""

from __future__ import annotations

import functools
import struct
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from google.protobuf.message import DecodeError

from ..proto import ps_pb2 as pb

CHUNK_BYTES = 2 * 1024 * 1024
# gRPC rejects messages above 4 MiB by default; frames are at most CHUNK_BYTES plus a
# few bytes, and the channel options raise the limit to leave room for big headers.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)

if sys.byteorder != "little":  # pragma: no cover - no big-endian hosts in practice
    raise ImportError("pstrain's wire format is little-endian; this host is big-endian")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

# Chunk frame prefix: field 2 (fixed32 seq), field 3 (fixed64 offset), field 4 (bytes).
_SEQ_TAG = 0x15
_OFF_TAG = 0x19
_DATA_TAG = 0x22
_PREFIX = struct.Struct("<BIBQB")  # seq tag, seq, offset tag, offset, data tag
_HEADER_TAG = 0x0A  # field 1, length-delimited: a header frame


class WireError(ValueError):
    """A stream that breaks the protocol: the message says what and where."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError as exc:
        raise WireError(f"dtype {dtype} cannot travel on the wire; use one of "
                        f"{sorted(DTYPES)}") from exc


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError as exc:
        raise WireError(f"dtype {name!r} is not one of {sorted(DTYPES)}") from exc


def _fresh_byte_view(tensor: torch.Tensor) -> np.ndarray:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise WireError("tensors on the wire must be contiguous and on the CPU")
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


# id(tensor) -> (weak reference to the tensor, its data_ptr and nbytes when viewed, view)
_VIEWS: dict[int, tuple[weakref.ref, int, int, np.ndarray]] = {}


def _forget_view(ref: weakref.ref, key: int) -> None:
    """Weak-reference callback: `ref`'s tensor is gone; drop its entry unless the id
    already names a newer tensor's entry."""
    entry = _VIEWS.get(key)
    if entry is not None and entry[0] is ref:
        _VIEWS.pop(key, None)


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view sharing `tensor`'s memory (contiguous CPU only).

    Making a view costs several microseconds (detach, reshape, view, numpy), and the
    same long-lived tensors (a model's parameters and gradients, a server's parameters
    and pooled scratch buffers) are viewed on every call, so views are cached per tensor
    object:

    - The key is `id(tensor)`, and the entry holds a weak reference to the tensor: a hit
      needs the reference to still name this very tensor (an id can be reused once a
      tensor dies), and the entry is dropped by the reference's callback when the tensor
      is collected. The cache therefore never keeps a tensor object alive.
    - The cached numpy view keeps the tensor's storage alive (as any numpy view does),
      so it can never point to freed memory. A hit also needs the tensor's `data_ptr`
      and byte count to be those seen when the view was made, and the tensor to still
      be contiguous; a tensor whose storage was replaced (`set_`, `resize_`, `.data =`)
      or resized gets a fresh view, which replaces the entry and releases the old
      storage. Until then, an old storage stays referenced by the entry.
    - Lookups and updates are single dict operations (atomic under the GIL); two threads
      missing at once both build equal views, and the last one stays.
    """
    key = id(tensor)
    entry = _VIEWS.get(key)
    if (entry is not None and entry[0]() is tensor and entry[1] == tensor.data_ptr()
            and entry[2] == tensor.nbytes and tensor.is_contiguous()):
        return entry[3]
    view = _fresh_byte_view(tensor)
    try:
        ref = weakref.ref(tensor, functools.partial(_forget_view, key=key))
    except TypeError:  # pragma: no cover - a tensor type without weak references
        return view
    _VIEWS[key] = (ref, tensor.data_ptr(), tensor.nbytes, view)
    return view


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def meta_of(name: str, tensor: torch.Tensor) -> pb.TensorMeta:
    return pb.TensorMeta(name=name, dtype=dtype_name(tensor.dtype), shape=list(tensor.shape))


def meta_nbytes(meta: pb.TensorMeta) -> int:
    dtype = parse_dtype(meta.dtype)
    count = 1
    for dim in meta.shape:
        if dim < 0:
            raise WireError(f"tensor {meta.name!r} has negative dimension {dim}")
        count *= dim
    return count * torch.empty((), dtype=dtype).element_size()


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int, bool]:
    """The protobuf varint starting at `buf[pos]`: (value, position after it, whether it
    ended before the buffer did or 64 bits were read)."""
    value = 0
    shift = 0
    while pos < len(buf) and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos, True
    return value, pos, False


def encode_header(header: pb.StreamHeader) -> bytes:
    return pb.Frame(header=header).SerializeToString()


def _chunk_prefix(seq: int, offset: int, size: int) -> bytes:
    return _PREFIX.pack(_SEQ_TAG, seq, _OFF_TAG, offset, _DATA_TAG) + _varint(size)


def encode_chunk(seq: int, offset: int, parts: Sequence[memoryview | bytes]) -> bytes:
    """One chunk frame from `parts` (joined: the single copy on the sending side)."""
    return b"".join((_chunk_prefix(seq, offset, sum(len(p) for p in parts)), *parts))


@dataclass(frozen=True)
class Chunk:
    seq: int
    offset: int
    data: memoryview


# A hand-encoded chunk frame's prefix and data length fit in this many bytes.
CHUNK_HEAD_BYTES = _PREFIX.size + 10


@dataclass(frozen=True)
class ChunkHead:
    """The start of a hand-encoded chunk frame: its data are `size` bytes from `start`."""

    seq: int
    offset: int
    size: int
    start: int
    complete: bool  # the data length ended within the bytes given


def chunk_head(buf: bytes | memoryview) -> ChunkHead | None:
    """The chunk prefix at the start of `buf` (a frame, or its first bytes), or None when
    `buf` does not start like a hand-encoded chunk frame."""
    if len(buf) >= _PREFIX.size + 1 and buf[0] == _SEQ_TAG:
        _, seq, tag_o, offset, tag_d = _PREFIX.unpack_from(buf, 0)
        if tag_o == _OFF_TAG and tag_d == _DATA_TAG:
            size, pos, complete = _read_varint(buf, _PREFIX.size)
            return ChunkHead(seq, offset, size, pos, complete)
    return None


def decode_frame(message: bytes) -> pb.StreamHeader | Chunk:
    """A header or a zero-copy chunk from one frame message."""
    head = chunk_head(message)
    if head is not None:
        # An unfinished length leaves `size` partial, and the check below names the
        # mismatch.
        if head.start + head.size != len(message):
            raise WireError(
                f"chunk {head.seq} declares {head.size} data bytes but carries "
                f"{len(message) - head.start}; the frame is truncated or corrupt"
            )
        return Chunk(head.seq, head.offset, memoryview(message)[head.start:])
    try:
        frame = pb.Frame.FromString(bytes(message))
    except DecodeError as exc:
        raise WireError(f"a frame could not be decoded: {exc}") from exc
    if frame.HasField("header"):
        return frame.header
    return Chunk(frame.seq, frame.offset, memoryview(frame.data))


_BATCH_TAG = b"\x0a"  # FrameBatch field 1, length-delimited


def encode_batch(frames: Iterator[bytes]) -> bytes:
    """A `FrameBatch` message holding `frames` (a whole small stream). A writer's
    `FrameStream` not yet iterated is encoded with a single copy of the tensors' bytes
    (its frames are never joined on their own)."""
    if isinstance(frames, FrameStream) and not frames.started:
        return frames.batch()
    return _join_batch([frame] for frame in frames)


def _join_batch(frames: Iterable[Sequence[bytes | memoryview]]) -> bytes:
    """A `FrameBatch` of frames each given as the parts that make it up: one join."""
    parts: list[bytes | memoryview] = []
    for frame in frames:
        parts += (_BATCH_TAG, _varint(sum(len(p) for p in frame)), *frame)
    return b"".join(parts)


def decode_batch(message: bytes) -> list[memoryview]:
    """The frames of a `FrameBatch` message, as zero-copy views."""
    view = memoryview(message)
    frames: list[memoryview] = []
    pos = 0
    while pos < len(view):
        if view[pos] != _BATCH_TAG[0]:
            raise WireError(f"a frame batch has an unexpected field tag {view[pos]:#x} at "
                            f"byte {pos}")
        size, pos, complete = _read_varint(view, pos + 1)
        if not complete:
            raise WireError("a frame batch ends inside a length; it is truncated")
        if pos + size > len(view):
            raise WireError(f"a frame batch declares a {size}-byte frame but holds only "
                            f"{len(view) - pos} more bytes; it is truncated")
        frames.append(view[pos:pos + size])
        pos += size
    return frames


class StreamWriter:
    """Frames for a header and tensors: the header frame, then chunks of about
    `chunk_bytes`, coalescing small tensors so that a chunk may span several."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes is {chunk_bytes}; it must be at least 1")
        self.chunk_bytes = chunk_bytes

    def frames(self, header: pb.StreamHeader,
               tensors: Sequence[torch.Tensor]) -> FrameStream:
        """The stream's frames, made lazily as they are iterated (errors included)."""
        return FrameStream(self._frame_parts(header, tensors))

    def _frame_parts(self, header: pb.StreamHeader,
                     tensors: Sequence[torch.Tensor]) -> Iterator[list[bytes | memoryview]]:
        """Each frame as the list of parts it is the concatenation of."""
        if len(header.tensors) != len(tensors):
            raise WireError(f"header lists {len(header.tensors)} tensors, got {len(tensors)}")
        header.total_bytes = sum(nbytes(t) for t in tensors)
        yield [encode_header(header)]
        seq = 0
        offset = 0
        parts: list[bytes | memoryview] = []
        pending = 0
        for tensor in tensors:
            view = memoryview(byte_view(tensor))
            pos = 0
            while pos < len(view):
                take = min(self.chunk_bytes - pending, len(view) - pos)
                parts.append(view[pos:pos + take] if take < len(view) else view)
                pending += take
                pos += take
                if pending == self.chunk_bytes:
                    yield [_chunk_prefix(seq, offset, pending), *parts]
                    seq += 1
                    offset += pending
                    parts, pending = [], 0
        if pending:
            yield [_chunk_prefix(seq, offset, pending), *parts]


class FrameStream:
    """An iterator over one stream's frames (bytes), made lazily. `encode_batch` of a
    stream not yet started joins all frames at once instead: one copy of the tensors'
    bytes, not one per frame and another for the batch."""

    def __init__(self, frame_parts: Iterator[list[bytes | memoryview]]) -> None:
        self._frame_parts = frame_parts
        self.started = False

    def __iter__(self) -> FrameStream:
        return self

    def __next__(self) -> bytes:
        self.started = True
        parts = next(self._frame_parts)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def parts(self) -> Iterator[list[bytes | memoryview]]:
        """The frames, each as the list of parts (a prefix, then views of the tensors'
        memory) it is the concatenation of: a socket can send them with no copy."""
        if self.started:
            raise WireError("a frame stream already partly read cannot be read by parts")
        self.started = True
        return self._frame_parts

    def batch(self) -> bytes:
        """The whole stream as one `FrameBatch` message (see `encode_batch`)."""
        if self.started:
            raise WireError("a frame stream already partly read cannot be batched")
        self.started = True
        return _join_batch(self._frame_parts)


class StreamReader:
    """Writes the chunks of one stream straight into destination byte views.

    `targets` are the destinations in header order (uint8 numpy views, see
    `byte_view`); the reader checks each chunk's seq and offset against what it
    expects next and `finish()` checks the byte count.
    """

    def __init__(self, header: pb.StreamHeader, targets: Sequence[np.ndarray]) -> None:
        self.header = header
        self.targets = list(targets)
        self.ends: list[int] = []
        end = 0
        for target in self.targets:
            end += target.nbytes
            self.ends.append(end)
        if end != header.total_bytes:
            raise WireError(
                f"the header says {header.total_bytes} bytes but its tensors hold {end}"
            )
        self.expected_seq = 0
        self.received = 0
        self._index = 0  # first target not yet full
        self._skip_empty()
        # Told (start, end) of each stretch of stream bytes once it is in the targets,
        # while it is still in cache (the store sums pushed gradients this way).
        self.on_data: Callable[[int, int], None] | None = None

    def filled(self, start: int, end: int) -> None:
        """Stream bytes [start, end) are in the targets (a receiver filling the
        `destinations` itself calls this after each chunk)."""
        if self.on_data is not None:
            self.on_data(start, end)

    def _skip_empty(self) -> None:
        while self._index < len(self.targets) and self.targets[self._index].nbytes == 0:
            self._index += 1

    def feed(self, chunk: Chunk) -> None:
        src = np.frombuffer(chunk.data, dtype=np.uint8)
        pos = 0
        for dst in self.destinations(chunk.seq, chunk.offset, len(chunk.data)):
            dst[:] = src[pos:pos + len(dst)]
            pos += len(dst)
        self.filled(chunk.offset, chunk.offset + len(chunk.data))

    def destinations(self, seq: int, offset: int, size: int) -> list[np.ndarray]:
        """Where the `size` data bytes of chunk `seq` at byte `offset` go: slices of the
        targets, in order, after the checks of `feed`. The reader counts the bytes as
        received: the caller fills every slice (a receiver can read a chunk's data
        straight into them, with no copy in between) or abandons the stream."""
        if seq != self.expected_seq:
            raise WireError(
                f"chunk {seq} arrived where chunk {self.expected_seq} was expected; "
                "chunks must arrive in order"
            )
        if offset != self.received:
            raise WireError(
                f"chunk {seq} starts at byte {offset}, expected byte "
                f"{self.received}; chunks must be contiguous and in order"
            )
        if self.received + size > self.header.total_bytes:
            raise WireError(
                f"chunk {seq} overruns the stream: {self.received + size} bytes "
                f"received, the header says {self.header.total_bytes}"
            )
        out: list[np.ndarray] = []
        pos = 0
        while pos < size:
            index = self._index
            target = self.targets[index]
            at = self.received + pos - (self.ends[index] - target.nbytes)
            take = min(size - pos, target.nbytes - at)
            out.append(target[at:at + take])
            pos += take
            if at + take == target.nbytes:
                self._index += 1
                self._skip_empty()
        self.received += size
        self.expected_seq += 1
        return out

    def finish(self) -> None:
        if self.received != self.header.total_bytes:
            raise WireError(
                f"the stream ended after {self.received} of {self.header.total_bytes} "
                "bytes; it was truncated"
            )


def decode_chunk(message: bytes | memoryview) -> Chunk:
    """A chunk frame after a stream's header."""
    chunk = decode_frame(message)  # type: ignore[arg-type]
    if not isinstance(chunk, Chunk):
        raise WireError("a second header frame arrived in the middle of a stream")
    return chunk


class DirectChunks(Protocol):
    """A source of frames that can write chunk data straight into a reader's
    destinations (`StreamReader.destinations`), with no copy in between: a socket."""

    def read_chunks_into(self, reader: StreamReader) -> None:
        """Read the stream's remaining frames into `reader` (not `finish`ed)."""


def read_body(reader: StreamReader, messages: Iterator[bytes]) -> None:
    """The rest of a stream (its chunks) into `reader`, then the byte-count check; a
    `DirectChunks` source is read straight into the destinations."""
    direct = getattr(messages, "read_chunks_into", None)  # a DirectChunks source
    if direct is not None:
        direct(reader)
    else:
        for message in messages:
            reader.feed(decode_chunk(message))
    reader.finish()


def read_stream(
    messages: Iterator[bytes],
    targets_for: Callable[[pb.StreamHeader], Sequence[np.ndarray]],
) -> pb.StreamHeader:
    """Read a whole stream: the header, then every chunk into `targets_for(header)`."""
    first = next(messages, None)
    if first is None:
        raise WireError("the stream was empty; it must start with a header frame")
    header = decode_frame(first)
    if not isinstance(header, pb.StreamHeader):
        raise WireError("the stream did not start with a header frame")
    read_body(StreamReader(header, targets_for(header)), messages)
    return header
