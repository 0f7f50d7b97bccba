"""The data plane reads chunk frames straight into the destination tensors
(`dataplane.LinkFrames.read_chunks_into`, and `CallReply` for a client's calls): same
bytes and same refusals as the buffered path, and the connection stays in step after a
refusal."""

from __future__ import annotations

import gc
import socket
import threading
from collections.abc import Iterator

import pytest
import torch

from pstrain_runtime.optim import OptimizerConfig
from pstrain_runtime.proto import ps_pb2 as pb
from pstrain_runtime.ps.store import ParameterStore, PSError
from pstrain_runtime.transport import dataplane, wire
from pstrain_runtime.worker.client import LocalTransport, ShardedClient
from pstrain_runtime.worker.placement import build_placement, param_specs

from .test_rt_wire import frames_of, protobuf_encoded_frames


@pytest.fixture
def links() -> Iterator[tuple[dataplane.Link, dataplane.Link]]:
    listener = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    listener.close()
    sender, receiver = dataplane.Link(a), dataplane.Link(b)
    yield sender, receiver
    sender.close()
    receiver.close()


def send(link: dataplane.Link, *messages: list[bytes]) -> threading.Thread:
    """Send each message (frames then END) from a thread: a big one fills the socket."""
    def run() -> None:
        for frames in messages:
            link.send_frames(frames)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def receive(link: dataplane.Link, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One stream read with the direct path, into fresh tensors shaped like `like`."""
    out = {n: torch.full_like(t, -1) for n, t in like.items()}
    frames = link.frames()
    header = wire.decode_frame(bytes(next(frames)))
    assert isinstance(header, pb.StreamHeader)
    wire.read_body(wire.StreamReader(header, [wire.byte_view(t) for t in out.values()]),
                   frames)
    return out


TENSORS = {
    "a": torch.randn(1000, 3),
    "empty": torch.empty(0, 4),
    "b": torch.randn(77).to(torch.bfloat16),
    "c": torch.randn(5, 5).half(),
}


@pytest.mark.parametrize("chunk_bytes", [3, 24, 1000, wire.CHUNK_BYTES],
                         ids=["smaller-than-a-prefix", "tiny", "spanning", "one-chunk"])
def test_direct_receive_equals_the_sent_tensors(links, chunk_bytes: int) -> None:
    sender, receiver = links
    after = {"after": torch.arange(5, dtype=torch.float32)}
    thread = send(sender, frames_of(TENSORS, chunk_bytes), frames_of(after, 8))
    got = receive(receiver, TENSORS)
    assert receive(receiver, after)["after"].tolist() == [0, 1, 2, 3, 4]  # still in step
    thread.join(10)
    for name, tensor in TENSORS.items():
        assert torch.equal(got[name], tensor), name


def test_a_large_stream_is_received_directly() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    sender = dataplane.Link(socket.create_connection(listener.getsockname()))
    receiver = dataplane.Link(listener.accept()[0])
    listener.close()
    big = {"w": torch.randn(3 * 1024 * 1024 + 7)}  # several 2 MiB chunks, and a tail
    try:
        thread = send(sender, frames_of(big, wire.CHUNK_BYTES))
        assert torch.equal(receive(receiver, big)["w"], big["w"])
        thread.join(10)
        # Straight into the tensor: the link's buffer never had to hold a 2 MiB chunk.
        assert len(receiver._buf) == dataplane.COALESCE_BYTES
    finally:
        sender.close()
        receiver.close()


def test_protobuf_encoded_chunks_take_the_buffered_path(links) -> None:
    sender, receiver = links
    w = torch.arange(4, dtype=torch.float32)
    thread = send(sender, protobuf_encoded_frames(w))
    assert torch.equal(receive(receiver, {"w": w})["w"], w)
    thread.join(10)


def _swap(frames: list[bytes]) -> list[bytes]:
    return [frames[0], frames[2], frames[1], *frames[3:]]


def _cut_frame(frames: list[bytes]) -> list[bytes]:
    return [frames[0], frames[1][:-3], *frames[2:]]


REFUSED = {
    "out-of-order": (_swap, "chunk 1 arrived where chunk 0 was expected"),
    "gap": (lambda f: [f[0], wire.encode_chunk(0, 4, [b"\0" * 8]), *f[2:]],
            "starts at byte 4, expected byte 0"),
    "too-many-bytes": (lambda f: [*f, wire.encode_chunk(3, 24, [b"x" * 40])],
                       "overruns the stream"),
    "truncated-frame": (_cut_frame, "declares 8 data bytes but carries 5"),
    "second-header": (lambda f: [f[0], f[0], *f[1:]], "second header"),
    "truncated-stream": (lambda f: f[:-1], "ended after 16 of 24 bytes"),
}


@pytest.mark.parametrize(("mangle", "message"), REFUSED.values(), ids=REFUSED.keys())
def test_refused_chunks_leave_the_link_in_step(links, mangle, message: str) -> None:
    sender, receiver = links
    w = {"w": torch.arange(6, dtype=torch.float32)}
    thread = send(sender, mangle(frames_of(w, 8)), frames_of(w, 8))
    frames = receiver.frames()
    header = wire.decode_frame(bytes(next(frames)))
    target = torch.zeros(6)
    with pytest.raises(wire.WireError, match=message):
        wire.read_body(wire.StreamReader(header, [wire.byte_view(target)]), frames)
    for _ in frames:  # drained, as the server does before it answers with an error
        pass
    assert torch.equal(receive(receiver, w)["w"], w["w"])
    thread.join(10)


def test_an_error_answer_in_the_middle_of_a_stream_is_raised(links) -> None:
    sender, receiver = links
    w = {"w": torch.arange(6, dtype=torch.float32)}
    frames = frames_of(w, 8)

    def mid_stream_failure() -> Iterator[bytes]:
        yield from frames[:2]
        raise dataplane.PSError("NOT_FOUND", "gone")

    thread = send(sender, mid_stream_failure())
    with pytest.raises(dataplane.RemoteError, match="gone"):
        receive(receiver, w)
    thread.join(10)


def test_a_closed_connection_fails_the_read(links) -> None:
    sender, receiver = links
    w = {"w": torch.arange(6, dtype=torch.float32)}
    sender._send_parts([struct_frame(f) for f in frames_of(w, 8)[:2]])
    sender.close()
    with pytest.raises(ConnectionError, match="peer closed"):
        receive(receiver, w)


def struct_frame(frame: bytes) -> bytes:
    return len(frame).to_bytes(4, "little") + frame


# ---------------------------------------------------------------- a client's pulls
@pytest.fixture
def served() -> Iterator[tuple[ParameterStore, dataplane.DataClient]]:
    """A store with `BIG_PARAMS` behind a DataServer on 127.0.0.1, and a client."""
    store = ParameterStore()
    placement = build_placement(param_specs({n: t.shape for n, t in BIG_PARAMS.items()}), 1)
    ShardedClient([LocalTransport(store)], placement, "ns").init(
        BIG_PARAMS, OptimizerConfig(), mode="async", num_workers=1, staleness_bound=None,
        fingerprint="ab")
    server = dataplane.DataServer(store, "127.0.0.1")
    port = server.start()
    client = dataplane.DataClient("ps-0", "127.0.0.1", port)
    yield store, client
    client.close()
    server.stop()


BIG_PARAMS = {"w": torch.randn(1280, 1024), "b": torch.randn(7)}  # 5 MiB: three chunks


def pull(client: dataplane.DataClient, out: dict[str, torch.Tensor]) -> pb.StreamHeader:
    request = pb.PullRequest(namespace="ns", names=list(out)).SerializeToString()
    return wire.read_stream(client.call(dataplane.OP_PULL, [request]),
                            lambda header: [wire.byte_view(out[m.name]) for m in header.tensors])


def test_a_pull_is_received_straight_into_the_parameters(served) -> None:
    _, client = served
    for _ in range(2):  # the second call reuses the pooled connection
        out = {n: torch.zeros_like(t) for n, t in BIG_PARAMS.items()}
        pull(client, out)
        assert all(torch.equal(out[n], t) for n, t in BIG_PARAMS.items())
        assert [len(link._buf) for link in client._idle] == [dataplane.COALESCE_BYTES]


def test_a_refused_pull_keeps_the_connection_and_a_broken_one_drops_it(served) -> None:
    _, client = served
    with pytest.raises(PSError, match="tensor 'nope' is not on parameter server") as err:
        pull(client, {"nope": torch.zeros(1)})
    assert err.value.code == "NOT_FOUND"
    assert len(client._idle) == 1  # an answered refusal leaves the link in step
    short = {"w": torch.zeros(1280, 1024), "b": torch.zeros(7)}
    with pytest.raises(wire.WireError, match="its tensors hold"):
        wire.read_stream(client.call(dataplane.OP_PULL, [pb.PullRequest(
            namespace="ns", names=["w", "b"]).SerializeToString()]),
            lambda header: [wire.byte_view(short["w"])])
    gc.collect()
    assert client._idle == []  # abandoned mid-response: closed, not pooled
    out = {n: torch.zeros_like(t) for n, t in BIG_PARAMS.items()}
    pull(client, out)
    assert torch.equal(out["w"], BIG_PARAMS["w"])
