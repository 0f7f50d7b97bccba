"""Tensors on the wire: raw bytes in ~2 MiB chunks, decoded in order, checked for size."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from pstrain_runtime.proto import ps_pb2 as pb
from pstrain_runtime.transport import wire


def header_for(tensors: dict[str, torch.Tensor]) -> pb.StreamHeader:
    return pb.StreamHeader(kind=pb.STREAM_KIND_PUSH, namespace="ns",
                           tensors=[wire.meta_of(n, t) for n, t in tensors.items()])


def frames_of(tensors: dict[str, torch.Tensor], chunk_bytes: int = wire.CHUNK_BYTES) -> list[bytes]:
    return list(wire.StreamWriter(chunk_bytes).frames(header_for(tensors), list(tensors.values())))


def read_into(frames: list[bytes], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {n: torch.empty_like(t) for n, t in like.items()}
    wire.read_stream(iter(frames), lambda h: [wire.byte_view(out[m.name]) for m in h.tensors])
    return out


def test_large_tensor_is_chunked_and_round_trips() -> None:
    big = torch.randn(3 * 1024 * 1024 + 7)  # 12 MiB + 28 bytes: more than 8 MiB
    frames = frames_of({"big": big})
    chunk_sizes = [len(f) for f in frames[1:]]
    assert len(chunk_sizes) == 7
    assert max(chunk_sizes) <= wire.CHUNK_BYTES + 32
    assert all(size > 1024 * 1024 for size in chunk_sizes[:-1])
    assert torch.equal(read_into(frames, {"big": big})["big"], big)


def test_chunks_span_tensor_boundaries_and_dtypes() -> None:
    tensors = {
        "a": torch.randn(1000, 3),
        "empty": torch.empty(0, 4),
        "b": torch.randn(77).to(torch.bfloat16),
        "c": torch.randn(5, 5).half(),
        "d": torch.arange(10, dtype=torch.int64),
    }
    frames = frames_of(tensors, chunk_bytes=1000)
    out = read_into(frames, tensors)
    for name, tensor in tensors.items():
        assert torch.equal(out[name], tensor), name


def test_chunk_frames_are_valid_protobuf() -> None:
    frames = frames_of({"w": torch.arange(6, dtype=torch.float32)}, chunk_bytes=8)
    parsed = pb.Frame.FromString(frames[2])
    assert (parsed.seq, parsed.offset, len(parsed.data)) == (1, 8, 8)
    assert pb.Frame.FromString(frames[0]).header.total_bytes == 24


def protobuf_encoded_frames(w: torch.Tensor) -> list[bytes]:
    """A stream of `w` in two chunks encoded by protobuf, not by hand."""
    header = header_for({"w": w})
    header.total_bytes = wire.nbytes(w)
    raw = w.numpy().tobytes()
    half = len(raw) // 2
    return [pb.Frame(header=header).SerializeToString(),
            pb.Frame(seq=0, offset=0, data=raw[:half]).SerializeToString(),
            pb.Frame(seq=1, offset=half, data=raw[half:]).SerializeToString()]


def test_protobuf_encoded_chunks_are_accepted_too() -> None:
    w = torch.arange(4, dtype=torch.float32)
    assert torch.equal(read_into(protobuf_encoded_frames(w), {"w": w})["w"], w)


def _swap(frames: list[bytes]) -> list[bytes]:
    return [frames[0], frames[2], frames[1], *frames[3:]]


def _wrong_offset(frames: list[bytes]) -> list[bytes]:
    return [frames[0], wire.encode_chunk(0, 4, [b"\0" * 8]), *frames[2:]]


def _cut_frame(frames: list[bytes]) -> list[bytes]:
    return [frames[0], frames[1][:-3], *frames[2:]]


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        pytest.param(_swap, "chunk 1 arrived where chunk 0 was expected", id="out-of-order"),
        pytest.param(lambda f: f[:-1], "ended after 16 of 24 bytes; it was truncated",
                     id="truncated-stream"),
        pytest.param(_cut_frame, "declares 8 data bytes but carries 5", id="truncated-frame"),
        pytest.param(_wrong_offset, "starts at byte 4, expected byte 0", id="gap-or-overlap"),
        pytest.param(lambda f: [*f, wire.encode_chunk(3, 24, [b"x"])], "overruns the stream",
                     id="too-many-bytes"),
        pytest.param(lambda f: [f[0], f[0], *f[1:]], "second header", id="second-header"),
        pytest.param(lambda f: f[1:], "did not start with a header", id="no-header"),
        pytest.param(lambda f: [], "stream was empty", id="empty"),
        pytest.param(lambda f: [f[0], b"\x15garbage"], "could not be decoded", id="garbage"),
    ],
)
def test_broken_streams_are_rejected(mangle, message) -> None:
    w = torch.arange(6, dtype=torch.float32)
    frames = frames_of({"w": w}, chunk_bytes=8)
    with pytest.raises(wire.WireError, match=message):
        read_into(mangle(frames), {"w": w})


def test_unknown_dtype_is_named() -> None:
    with pytest.raises(wire.WireError, match="dtype 'complex32' is not one of"):
        wire.parse_dtype("complex32")


# ---------------------------------------------------------------- byte_view's cache
def test_byte_view_of_the_same_tensor_is_cached_and_writes_through() -> None:
    t = torch.zeros(4)
    first = wire.byte_view(t)
    assert wire.byte_view(t) is first
    first[:4] = np.frombuffer(np.float32(2.5).tobytes(), dtype=np.uint8)
    assert t[0].item() == 2.5


def _set_new_storage(t: torch.Tensor) -> None:
    t.set_(torch.full((4,), 7.0))


def _assign_data(t: torch.Tensor) -> None:
    t.data = torch.full((4,), 7.0)


def _shrink(t: torch.Tensor) -> None:
    t.resize_(2)
    t.fill_(7.0)


def _grow(t: torch.Tensor) -> None:
    # A storage once viewed by numpy cannot be resized past its size (torch's rule, cache
    # or not); a larger tensor gets new storage through set_.
    t.set_(torch.full((1 << 16,), 7.0))


@pytest.mark.parametrize("change", [_set_new_storage, _assign_data, _shrink, _grow],
                         ids=["set_", "data=", "resize-smaller", "resize-larger"])
def test_byte_view_of_a_tensor_whose_storage_changed_is_made_again(change) -> None:
    t = torch.zeros(4)
    old = wire.byte_view(t)
    change(t)
    new = wire.byte_view(t)
    assert new is not old
    assert new.nbytes == t.nbytes
    assert new.ctypes.data == t.data_ptr()
    assert torch.equal(torch.from_numpy(new.copy()).view(torch.float32), t)


def test_byte_view_of_a_tensor_made_non_contiguous_in_place_is_refused() -> None:
    t = torch.zeros(3, 4)
    wire.byte_view(t)
    t.t_()  # same storage and size, other strides
    with pytest.raises(wire.WireError, match="must be contiguous and on the CPU"):
        wire.byte_view(t)


def test_byte_view_cache_keeps_no_tensor_alive_and_forgets_dead_ones() -> None:
    t = torch.zeros(1000)
    alive = weakref.ref(t)
    wire.byte_view(t)
    key = id(t)
    assert key in wire._VIEWS
    del t
    gc.collect()
    assert alive() is None
    assert key not in wire._VIEWS


def test_byte_view_of_a_new_tensor_at_a_reused_id_is_its_own() -> None:
    # Whatever id a new tensor gets, its view is of its own memory, never a stale entry.
    for value in range(50):
        t = torch.full((8,), float(value))
        view = wire.byte_view(t)
        assert torch.equal(torch.from_numpy(view.copy()).view(torch.float32), t)
        del t, view


def test_byte_view_survives_a_stale_entry_for_its_id() -> None:
    # A stale entry (as if the callback had not run yet) is not mistaken for a hit.
    t = torch.ones(4)
    other = torch.zeros(4)
    wire._VIEWS[id(t)] = (weakref.ref(other), t.data_ptr(), t.nbytes, wire.byte_view(other))
    view = wire.byte_view(t)
    assert view.ctypes.data == t.data_ptr()


# ---------------------------------------------------------------- batches in one copy
def test_batch_of_an_unstarted_stream_equals_batch_of_its_frames() -> None:
    tensors = {"a": torch.randn(300), "b": torch.randn(7).half(), "c": torch.empty(0)}
    for chunk_bytes in (100, wire.CHUNK_BYTES):
        fast = wire.encode_batch(wire.StreamWriter(chunk_bytes).frames(
            header_for(tensors), list(tensors.values())))
        slow = wire.encode_batch(iter(frames_of(tensors, chunk_bytes)))
        assert fast == slow
        assert [bytes(f) for f in wire.decode_batch(fast)] == frames_of(tensors, chunk_bytes)


def test_a_partly_read_stream_is_batched_from_where_it_is() -> None:
    tensors = {"a": torch.randn(30)}
    stream = wire.StreamWriter(40).frames(header_for(tensors), list(tensors.values()))
    header = next(stream)
    rest = wire.encode_batch(stream)
    assert [header, *map(bytes, wire.decode_batch(rest))] == frames_of(tensors, 40)
    with pytest.raises(wire.WireError, match="already partly read cannot be batched"):
        stream.batch()


def test_a_stream_with_a_header_that_does_not_match_fails_when_read() -> None:
    stream = wire.StreamWriter().frames(header_for({"a": torch.zeros(1)}), [])
    with pytest.raises(wire.WireError, match="header lists 1 tensors, got 0"):
        wire.encode_batch(stream)
