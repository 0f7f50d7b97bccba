"""Credentials are bounded, accepted once, and bound to one worker (issues 26.2, 27.2,
27.3), against a real in-process server holding job A's keys (`test_rt_auth`'s).

- every field of a gRPC proof is bounded: anything else, even signed with the right
  key, is refused UNAUTHENTICATED with one sentence, never UNKNOWN, never accepted;
- a proof is accepted once within its window whatever the call rate; the replay cache
  stays bounded and refuses (RESOURCE_EXHAUSTED) rather than forgets when full;
- worker i's own key acts only as worker i on both channels, the job's shared worker
  key only reads status, the chief acts for anyone; and the keys of the operator's
  Secret still work (a worker pod derives its own key from the Secret's worker key).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import socket
import time
from collections.abc import Callable

import grpc
import pytest
import torch
from pstrain_api import security
from pstrain_runtime.proto import ps_pb2 as pb
from pstrain_runtime.ps.server import SERVICE, PSServer
from pstrain_runtime.sparse import protocol as sparse_protocol
from pstrain_runtime.transport import auth, wire
from pstrain_runtime.worker.client import GrpcTransport, TcpTransport

from tests.runtime.test_rt_auth import (CALLS, CHIEF_A, JOB_A, NS, _refusal, push_frames,
                                        server, sharded, state_of)

pytestmark = pytest.mark.timeout(120)
_ = server  # the fixture

KEYS_A = security.derive_keys(JOB_A)
EVERY_A = auth.Credentials.from_token(JOB_A)
SHARED_A = EVERY_A.only(security.KEY_WORKER)
WORKER_1 = SHARED_A.for_worker(1)
INFO = f"/{SERVICE}/Info"
TRANSPORTS = pytest.mark.parametrize("transport", [GrpcTransport, TcpTransport],
                                     ids=["grpc", "tcp"])


# ---------------------------------------------------------------------- 26.2 bounds


def signed(stamp: str, nonce: str, role: str = "chief", method: str = INFO) -> str:
    """A proof with these fields and a MAC made with A's real key for `role`."""
    key = EVERY_A.key_of(role) or b""
    return f"{role} {stamp} {nonce} {auth._grpc_mac(key, method, stamp, nonce)}"


def now_ms() -> str:
    return str(int(time.time() * 1000))


MALFORMED_PROOFS: dict[str, Callable[[], str]] = {
    "310-digit time": lambda: signed("9" * 310, "ab" * 12),
    "5000-digit time": lambda: signed("1" * 5000, "ab" * 12),
    "4 KiB nonce": lambda: signed(now_ms(), "ab" * 2048),  # 8 KiB: below
    "short nonce": lambda: signed(now_ms(), "ab"),
    "negative time": lambda: signed("-" + now_ms(), "ab" * 12),
    "uppercase MAC": lambda: signed(now_ms(), "ab" * 12).upper().replace("CHIEF", "chief"),
    "two spaces": lambda: signed(now_ms(), "ab" * 12).replace(" ", "  ", 1),
    "a fifth field": lambda: signed(now_ms(), "ab" * 12) + " x",
    "6 KiB": lambda: "chief " + "1" * 6_000,  # gRPC may refuse metadata over 8 KiB
    "long role": lambda: signed(now_ms(), "ab" * 12, role="worker-" + "1" * 30),
    "index out of int32": lambda: signed(now_ms(), "ab" * 12, role="worker-2147483648"),
    "index with a leading zero": lambda: signed(now_ms(), "ab" * 12, role="worker-01"),
}


@pytest.mark.parametrize("case", list(MALFORMED_PROOFS))
def test_malformed_grpc_credentials_get_one_unauthenticated_sentence(
        server: PSServer, case: str) -> None:
    before = state_of(server)
    with grpc.insecure_channel(server.address) as channel:
        info = channel.unary_unary(INFO, pb.NamespaceRequest.SerializeToString,
                                   pb.StepInfo.FromString)
        with pytest.raises(grpc.RpcError) as caught:
            info(pb.NamespaceRequest(namespace=NS),
                 metadata=[(auth.METADATA_KEY, MALFORMED_PROOFS[case]())], timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert caught.value.details() == auth.MALFORMED
    assert state_of(server) == before


@pytest.mark.parametrize("value", ["chief \u0661\u0662\u0663 " + "ab" * 12 + " " + "0" * 64,
                                   b"chief 1 2 3", None, 7])
def test_credentials_that_are_not_ascii_text_are_malformed(value: object) -> None:
    guard = auth.ServerGuard(EVERY_A)
    metadata = [] if value is None else [(auth.METADATA_KEY, value)]
    with pytest.raises(auth.AuthError) as caught:
        guard.check(INFO, metadata)
    assert caught.value.code == "UNAUTHENTICATED"


def test_a_signed_8_kib_nonce_is_refused() -> None:
    """It was accepted: the nonce had no bound."""
    guard = auth.ServerGuard(EVERY_A)
    with pytest.raises(auth.AuthError, match="malformed"):
        guard.check(INFO, [(auth.METADATA_KEY, signed(now_ms(), "ab" * 4096))])
    guard.check(INFO, [(auth.METADATA_KEY, signed(now_ms(), "ab" * 12))])  # the same, bounded


def handshake(port: int, answer: Callable[[bytes], bytes]) -> bytes:
    """Open a data connection and answer its hello with `answer(nonce)`; the verdict."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        hello = b""
        while len(hello) < len(auth.MAGIC) + auth.NONCE_BYTES:
            hello += sock.recv(64)
        sock.sendall(answer(hello[len(auth.MAGIC):]))
        return sock.recv(1)


def own_answer(key: bytes, index: int) -> Callable[[bytes], bytes]:
    def answer(nonce: bytes) -> bytes:
        head = bytes((auth.OWN_WORKER_CODE,)) + index.to_bytes(4, "little")
        mac = hmac.new(key, auth.HANDSHAKE_CONTEXT + nonce + head, hashlib.sha256).digest()
        return head + mac[:28]
    return answer


def test_the_data_plane_handshake_binds_and_bounds_the_worker_index(server: PSServer) -> None:
    own_1 = security.own_worker_key(KEYS_A["worker"], 1)
    port = server.data_port
    assert handshake(port, own_answer(own_1, 1)) == auth.ACCEPTED
    assert handshake(port, own_answer(own_1, 0)) == auth.REFUSED  # 1's key, 0's index
    for index in (2**31, 2**32 - 1):  # beyond the wire's int32 worker fields
        assert handshake(port, own_answer(own_1, index)) == auth.REFUSED
    assert handshake(port, lambda nonce: b"\x07" + bytes(32)) == auth.REFUSED


# ---------------------------------------------------------------------- 27.2 replays


def test_a_proof_is_accepted_once_within_its_window_whatever_the_call_rate() -> None:
    """Issue 27: a proof was accepted again after 132,096 other calls in 80 s."""
    now = [1_000_000.0]
    guard = auth.ServerGuard(EVERY_A, window_s=300, clock=lambda: now[0])
    proof = auth.grpc_proof(CHIEF_A, INFO, now=now[0])
    guard.check(INFO, [(auth.METADATA_KEY, proof)])
    calls = 140_000
    for _ in range(calls):
        now[0] += 80 / calls
        guard.check(INFO, [(auth.METADATA_KEY, auth.grpc_proof(CHIEF_A, INFO, now=now[0]))])
    with pytest.raises(auth.AuthError, match="used before"):
        guard.check(INFO, [(auth.METADATA_KEY, proof)])
    # Past its window the proof is refused as too old, and the cache forgets it all.
    now[0] += 302
    with pytest.raises(auth.AuthError, match="too old"):
        guard.check(INFO, [(auth.METADATA_KEY, proof)])
    guard.check(INFO, [(auth.METADATA_KEY, auth.grpc_proof(CHIEF_A, INFO, now=now[0]))])
    assert len(guard.replays) == 1


def test_a_full_replay_cache_refuses_new_proofs_rather_than_forget_old_ones() -> None:
    now = [1_000_000.0]
    guard = auth.ServerGuard(EVERY_A, window_s=60, clock=lambda: now[0], replay_limit=100)
    proofs = [auth.grpc_proof(CHIEF_A, INFO, now=now[0]) for _ in range(101)]
    for proof in proofs[:100]:
        guard.check(INFO, [(auth.METADATA_KEY, proof)])
    with pytest.raises(auth.AuthError) as caught:
        guard.check(INFO, [(auth.METADATA_KEY, proofs[100])])
    assert caught.value.code == "RESOURCE_EXHAUSTED" and "retry later" in caught.value.message
    with pytest.raises(auth.AuthError, match="used before"):
        guard.check(INFO, [(auth.METADATA_KEY, proofs[0])])  # still remembered
    assert len(guard.replays) == 100
    now[0] += 62  # the window has passed: room again
    guard.check(INFO, [(auth.METADATA_KEY, auth.grpc_proof(CHIEF_A, INFO, now=now[0]))])
    assert len(guard.replays) == 1


# ---------------------------------------------------------------------- 27.3 identity


def sparse_push(worker: int) -> list[bytes]:
    return sparse_protocol.encode({"op": "push", "namespace": NS, "worker": worker,
                                   "step": 1, "tables": []})


# Calls that act for worker 0 (the chief's index), each with a request that would
# change or read state as that worker.
AS_WORKER_0: dict[str, Callable[[GrpcTransport], object]] = {
    "Push": lambda t: t.push(push_frames(worker=0)),
    "PushPull": lambda t: list(t.push_pull(push_frames(worker=0))),
    "PushPullSmall": lambda t: t.push_pull_small(wire.encode_batch(push_frames(worker=0))),
    "Pull": lambda t: list(t.pull(pb.PullRequest(namespace=NS, names=["w"], worker=0))),
    "Info": lambda t: t.info(NS, worker=0),
    "Sparse": lambda t: t.sparse(sparse_push(worker=0)),
}


@TRANSPORTS
@pytest.mark.parametrize("call", list(AS_WORKER_0))
def test_a_worker_acts_only_as_itself(server: PSServer, transport: type[GrpcTransport],
                                      call: str) -> None:
    before = state_of(server)
    worker = transport(server.address, WORKER_1)
    try:
        refusal = _refusal(lambda: AS_WORKER_0[call](worker))
        assert refusal.code == "PERMISSION_DENIED", refusal.message
        assert "worker 1's credentials; they cannot act for worker 0" in refusal.message
        assert state_of(server) == before
        assert worker.push(push_frames(worker=1)).applied  # as itself it trains
        assert worker.info(NS, worker=1).member
    finally:
        worker.close()


@TRANSPORTS
def test_the_shared_worker_key_reads_status_but_acts_for_no_worker(
        server: PSServer, transport: type[GrpcTransport]) -> None:
    before = state_of(server)
    shared = transport(server.address, SHARED_A)
    try:
        for call in ("Push", "PushPull", "PushPullSmall", "Pull", "Sparse"):
            refusal = _refusal(lambda call=call: AS_WORKER_0[call](shared))  # type: ignore[misc]
            assert refusal.code == "PERMISSION_DENIED", (call, refusal.message)
            assert "needs a worker's own credentials" in refusal.message
        assert state_of(server) == before
        assert shared.info(NS).initialized
        CALLS["GetJobStatus"](shared)
        CALLS["RequestCheckpoint"](shared)  # allowed by design (docs/runtime.md)
        stats = sparse_protocol.encode({"op": "stats", "namespace": NS})
        shared.sparse(stats)
        refusal = _refusal(lambda: CALLS["Sparse"](shared))  # configure: the chief's
        assert refusal.code == "PERMISSION_DENIED"
        assert "sparse configure needs the chief's credentials" in refusal.message
    finally:
        shared.close()


@TRANSPORTS
def test_the_chief_acts_for_any_worker(server: PSServer,
                                       transport: type[GrpcTransport]) -> None:
    chief = sharded(server, CHIEF_A, transport)
    try:
        assert chief.push({"w": torch.ones(4)}, worker=1)[0].applied
        assert chief.push({"w": torch.ones(4)}, worker=0)[0].applied
    finally:
        chief.close()


@TRANSPORTS
@pytest.mark.parametrize("what", ["mark", "rows", "removed"])
def test_only_the_chief_exports_sparse_rows(server: PSServer, transport: type[GrpcTransport],
                                            what: str) -> None:
    """A checkpoint's export is the chief's: its `mark` starts the record of evicted ids
    the chief's next delta relies on, and its pages are the whole table."""
    request = sparse_protocol.encode({"op": "export", "namespace": NS, "table": "t",
                                      "what": what, "since": 0, "start": 0, "limit": 8})
    for credentials in (WORKER_1, SHARED_A):
        caller = transport(server.address, credentials)
        try:
            refusal = _refusal(lambda caller=caller: caller.sparse(request))  # type: ignore[misc]
            assert refusal.code == "PERMISSION_DENIED", refusal.message
            assert "sparse export needs the chief's credentials" in refusal.message
        finally:
            caller.close()
    chief = transport(server.address, CHIEF_A)
    try:  # the chief gets past the credentials (this namespace has no tables)
        assert _refusal(lambda: chief.sparse(request)).code == "NOT_FOUND"
    finally:
        chief.close()


def ride(transport: TcpTransport, dense: int, rider: int) -> object:
    """A sparse push of worker `rider` riding on a dense push_pull of worker `dense`."""
    return transport.push_pull_sparse(wire.encode_batch(push_frames(worker=dense)),
                                      sparse_push(worker=rider))


def test_a_riding_sparse_push_acts_only_as_the_worker_itself(server: PSServer) -> None:
    """The data plane's PushPullSparse (`sparse.riding`) checks both parts: either one
    naming another worker is refused before anything is applied."""
    before = state_of(server)
    worker, shared = TcpTransport(server.address, WORKER_1), TcpTransport(server.address,
                                                                          SHARED_A)
    try:
        for dense, rider in ((0, 1), (1, 0), (0, 0)):
            refusal = _refusal(lambda dense=dense, rider=rider: ride(worker, dense, rider))  # type: ignore[misc]
            assert refusal.code == "PERMISSION_DENIED", (dense, rider, refusal.message)
            assert "worker 1's credentials; they cannot act for worker 0" in refusal.message
        refusal = _refusal(lambda: ride(shared, 1, 1))
        assert refusal.code == "PERMISSION_DENIED"
        assert "needs a worker's own credentials" in refusal.message
        assert state_of(server) == before
        # As itself it passes the identity checks and reaches the store, which refuses
        # the rows (this namespace has no tables) before it applies either part.
        refusal = _refusal(lambda: ride(worker, 1, 1))
        assert refusal.code == "NOT_FOUND" and "has no sparse tables" in refusal.message
        assert state_of(server) == before
        assert worker.push_pull_small(wire.encode_batch(push_frames(worker=1)))  # trains
    finally:
        worker.close()
        shared.close()


def test_a_worker_key_yields_neither_another_workers_key_nor_the_shared_one() -> None:
    own = {i: security.own_worker_key(KEYS_A["worker"], i) for i in range(3)}
    assert len({*own.values(), KEYS_A["worker"], KEYS_A["chief"]}) == 5
    assert WORKER_1.keys == {"worker-1": own[1]} and WORKER_1.role == "worker-1"
    assert WORKER_1.for_worker(1) == WORKER_1
    with pytest.raises(ValueError, match="not worker 2's"):
        WORKER_1.for_worker(2)
    assert CHIEF_A.for_worker(3) == CHIEF_A  # the chief keeps its own powers


@TRANSPORTS
def test_the_operators_secret_still_works(server: PSServer,
                                          transport: type[GrpcTransport]) -> None:
    """A worker pod mounts the Secret's worker key; its replica derives its own from it
    (`Credentials.for_worker`, as `replica.run_worker` does) and trains as itself."""
    from pstrain_operator.security import build_auth_secret, worker_keys

    from tests.operator.op_builders import make_job

    secret = build_auth_secret(make_job("j", "ns").build(), JOB_A)
    assert set(secret["data"]) == {"chief", "worker"}
    mounted = worker_keys(secret)
    assert base64.b64decode(secret["data"]["worker"]).decode().strip() == \
        mounted["worker"].hex()
    pod = sharded(server, auth.Credentials(mounted).for_worker(1), transport)
    try:
        assert pod.push({"w": torch.ones(4)}, worker=1)[0].applied
    finally:
        pod.close()
