"""The sparse calls' frames move tensors without copies of their own: `encode` gives
each tensor's bytes as a view of its memory, the data plane receives each frame of a
sparse call into a buffer of its own (on the server and on the client), and
`tensor_of` reads such a buffer in place. The same calls over gRPC, which carries bytes
only, give the same rows."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from pstrain_runtime.optim import OptimizerConfig
from pstrain_runtime.ps.server import PSServer
from pstrain_runtime.sparse.client import SparseClient
from pstrain_runtime.sparse.protocol import encode, header_of, tensor_of
from pstrain_runtime.sparse.spec import TableSpec
from pstrain_runtime.worker.client import GrpcTransport, ShardedClient, TcpTransport
from pstrain_runtime.worker.placement import build_placement, param_specs

pytestmark = pytest.mark.timeout(60)

ADAGRAD = OptimizerConfig(name="adagrad", learning_rate=0.1)
SPEC = TableSpec(name="items", num_embeddings=1000, embedding_dim=8, init_std=0.1,
                 optimizer=ADAGRAD)
IDS = torch.tensor([3, 999, 17, 400, 5])


def test_encode_gives_views_of_the_tensors_memory() -> None:
    rows = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    header, frame = encode({"op": "x"}, [rows])
    assert header_of([header]) == {"op": "x"}
    assert bytes(frame) == rows.numpy().tobytes()
    rows[0, 0] = 99.0  # a view, not a copy: the frame sees the change
    assert np.frombuffer(frame, np.float32)[0] == 99.0
    empty = encode({}, [torch.empty(0, 4)])[1]  # no rows: an empty frame
    assert len(empty) == 0


def test_tensor_of_reads_an_owned_buffer_in_place_and_copies_anything_else() -> None:
    owned = np.frombuffer(torch.arange(6, dtype=torch.int64).numpy().tobytes(),
                          np.uint8).copy()
    ids = tensor_of(owned, torch.int64, 0, "ids")
    assert ids.tolist() == list(range(6)) and np.shares_memory(ids.numpy(), owned)
    view = memoryview(owned)  # may be a buffer used again: copied
    copied = tensor_of(view, torch.int64, 0, "ids")
    assert copied.tolist() == list(range(6)) and not np.shares_memory(copied.numpy(), owned)
    rows = tensor_of(bytes(12 * 4), torch.float32, 4, "rows")
    assert rows.shape == (3, 4) and rows.numpy().flags.writeable


@pytest.fixture
def server() -> Iterator[PSServer]:
    ps = PSServer("127.0.0.1:0", ps_index=0, data_port=0)
    ps.start()
    yield ps
    ps.stop(0)


def _train(transport: GrpcTransport, namespace: str) -> tuple[torch.Tensor, list]:
    """Configure the table, push twice, pull: the rows, and the raw reply of a pull."""
    placement = build_placement(param_specs({"w": torch.Size([2])}), 1)
    ShardedClient([transport], placement, namespace).init(
        {"w": torch.zeros(2)}, ADAGRAD, mode="async", num_workers=1, staleness_bound=None,
        fingerprint="ab" * 32)
    client = SparseClient([transport], namespace)
    client.configure([SPEC], reset=True)
    for step in range(2):
        grads = torch.arange(IDS.numel() * 8, dtype=torch.float32).reshape(-1, 8) * (step + 1)
        client.push({"items": (IDS, grads)}, worker=0, steps=[step])
    raw = transport.sparse(encode({"op": "pull", "namespace": namespace,
                                   "tables": [{"name": "items", "count": IDS.numel()}]},
                                  [IDS]))
    return client.pull(SPEC, IDS), raw


def test_sparse_calls_over_the_data_plane_receive_owned_frames_and_match_grpc(
        server: PSServer) -> None:
    tcp, grpc_ = TcpTransport(server.address), GrpcTransport(server.address)
    try:
        tcp_rows, tcp_raw = _train(tcp, "tcp")
        grpc_rows, grpc_raw = _train(grpc_, "grpc")
    finally:
        tcp.close()
        grpc_.close()
    assert tcp._data is not None  # the calls went over the data plane
    # Each frame in a buffer of its own: the header and the rows do not share one.
    assert all(isinstance(frame, np.ndarray) for frame in tcp_raw)
    assert not np.shares_memory(tcp_raw[0], tcp_raw[1])
    assert all(isinstance(frame, bytes) for frame in grpc_raw)
    assert bytes(tcp_raw[1]) == bytes(grpc_raw[1])
    assert torch.equal(tcp_rows, grpc_rows)
    assert torch.equal(tensor_of(tcp_raw[1], torch.float32, 8, "rows"), tcp_rows)
