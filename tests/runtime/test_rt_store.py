"""The parameter server's rules, without sockets: bad input is refused with a status
code and a message and changes nothing; sync aggregation; staleness; namespaces."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from pstrain_runtime.optim import OptimizerConfig
from pstrain_runtime.proto import ps_pb2 as pb
from pstrain_runtime.ps.store import ParameterStore, PSError
from pstrain_runtime.transport import wire
from pstrain_runtime.worker.client import LocalTransport, ShardedClient
from pstrain_runtime.worker.placement import build_placement, param_specs

SGD = OptimizerConfig(name="sgd", learning_rate=0.5)
FP = "ab" * 32


def params() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(4)}


def connect(store: ParameterStore, namespace: str = "ns") -> ShardedClient:
    p = params()
    placement = build_placement(param_specs({n: t.shape for n, t in p.items()}), 1)
    return ShardedClient([LocalTransport(store)], placement, namespace, chunk_bytes=16)


def ready_store(mode: str = "async", num_workers: int = 1, staleness: int | None = None,
                config: OptimizerConfig = SGD) -> tuple[ParameterStore, ShardedClient]:
    store = ParameterStore()
    client = connect(store)
    client.init(params(), config, mode=mode, num_workers=num_workers,
                staleness_bound=staleness, fingerprint=FP)
    return store, client


def snapshot(store: ParameterStore, namespace: str = "ns") -> tuple:
    ns = store.namespace(namespace)
    return (ns.global_step, {k: v.clone() for k, v in ns.params.items()},
            {k: (s.step, {n: t.clone() for n, t in s.slots.items()}) for k, s in ns.states.items()})


def same(a: tuple, b: tuple) -> bool:
    return (a[0] == b[0] and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
            and a[2].keys() == b[2].keys()
            and all(a[2][k][0] == b[2][k][0] for k in a[2]))


def push_frames(tensors: dict[str, torch.Tensor], namespace: str = "ns", worker: int = 0,
                step: int = 0, chunk_bytes: int = 16) -> list[bytes]:
    header = pb.StreamHeader(kind=pb.STREAM_KIND_PUSH, namespace=namespace, worker=worker,
                             step=step,
                             tensors=[wire.meta_of(n, t) for n, t in tensors.items()])
    return list(wire.StreamWriter(chunk_bytes).frames(header, list(tensors.values())))


def good_grads() -> dict[str, torch.Tensor]:
    return {"b": torch.full((4,), 0.1), "w": torch.full((3, 4), 0.2)}


def with_value(value: float) -> dict[str, torch.Tensor]:
    g = good_grads()
    g["w"][1, 2] = value
    return g


BAD_PUSHES: dict[str, tuple[Callable[[], list[bytes]], str, str]] = {
    "unknown-tensor": (lambda: push_frames({"nope": torch.zeros(2)}), "NOT_FOUND",
                       "tensor 'nope' is not on parameter server 0"),
    "unknown-namespace": (lambda: push_frames(good_grads(), namespace="other"),
                          "FAILED_PRECONDITION", "namespace 'other' is not initialised"),
    "wrong-shape": (lambda: push_frames({"w": torch.zeros(4, 3)}), "INVALID_ARGUMENT",
                    r"gradient 'w' has shape \[4, 3\], the parameter has \[3, 4\]"),
    "wrong-dtype": (lambda: push_frames({"w": torch.zeros(3, 4, dtype=torch.int64)}),
                    "INVALID_ARGUMENT", "gradient 'w' has dtype int64"),
    "nan": (lambda: push_frames(with_value(float("nan"))), "INVALID_ARGUMENT",
            "gradient 'w' contains NaN or inf; .* rejected and not applied"),
    "inf": (lambda: push_frames(with_value(float("inf"))), "INVALID_ARGUMENT",
            "contains NaN or inf"),
    "out-of-order": (lambda: (lambda f: [f[0], f[2], f[1], *f[3:]])(push_frames(good_grads())),
                     "INVALID_ARGUMENT", "chunk 1 arrived where chunk 0 was expected"),
    "truncated": (lambda: push_frames(good_grads())[:-1], "INVALID_ARGUMENT",
                  "was truncated"),
    "bad-worker": (lambda: push_frames(good_grads(), worker=5), "INVALID_ARGUMENT",
                   "worker is 5; this job's workers are 0"),
    "duplicate-tensor": (lambda: push_frames(good_grads())[:1] and [
        wire.encode_header(pb.StreamHeader(kind=pb.STREAM_KIND_PUSH, namespace="ns",
                                           tensors=[wire.meta_of("b", torch.zeros(4))] * 2))],
        "INVALID_ARGUMENT", "tensor 'b' appears twice"),
    "wrong-kind": (lambda: [wire.encode_header(pb.StreamHeader(kind=pb.STREAM_KIND_INIT))],
                   "INVALID_ARGUMENT", "stream kind is STREAM_KIND_INIT"),
}


@pytest.mark.parametrize(("frames", "code", "message"), BAD_PUSHES.values(), ids=BAD_PUSHES.keys())
def test_bad_push_is_refused_and_changes_nothing(frames, code, message) -> None:
    store, _ = ready_store()
    before = snapshot(store)
    with pytest.raises(PSError, match=message) as err:
        store.push(iter(frames()))
    assert err.value.code == code
    assert same(snapshot(store), before)


def test_nonfinite_pushes_are_counted() -> None:
    store, client = ready_store()
    for _ in range(2):
        with pytest.raises(PSError):
            store.push(iter(push_frames(with_value(float("nan")))))
    assert client.info(0).skipped_nonfinite == 2


def test_push_before_initialisation_is_refused() -> None:
    store = ParameterStore()
    with pytest.raises(PSError, match="namespace 'ns' is not initialised") as err:
        store.push(iter(push_frames(good_grads())))
    assert err.value.code == "FAILED_PRECONDITION"
    with pytest.raises(PSError, match="not initialised"):
        connect(store).pull(params())


def test_async_push_applies_at_once_and_pull_sees_it() -> None:
    store, client = ready_store()
    replies = client.push(good_grads(), worker=0)
    assert replies[0].applied and replies[0].info.global_step == 1
    out = {k: torch.empty_like(v) for k, v in params().items()}
    assert client.pull(out) == 1
    torch.testing.assert_close(out["w"], params()["w"] - 0.5 * 0.2)
    torch.testing.assert_close(out["b"], params()["b"] - 0.5 * 0.1)


def test_sync_mode_waits_for_every_worker_and_applies_the_mean() -> None:
    store, client = ready_store(mode="sync", num_workers=2)
    result: dict[int, pb.PushReply] = {}
    g1 = {"b": torch.full((4,), 1.0), "w": torch.full((3, 4), 1.0)}
    g2 = {"b": torch.full((4,), 3.0), "w": torch.full((3, 4), -1.0)}

    first = threading.Thread(target=lambda: result.setdefault(0, client.push(g1, 0, 0)[0]))
    first.start()
    first.join(0.3)
    assert first.is_alive(), "worker 0's push must wait for worker 1"
    assert store.namespace("ns").global_step == 0
    result[1] = connect(store).push(g2, worker=1, step=0)[0]
    first.join(5)
    assert not first.is_alive()
    assert result[0].info.global_step == result[1].info.global_step == 1
    ns = store.namespace("ns")
    torch.testing.assert_close(ns.params["b"], torch.ones(4) - 0.5 * 2.0)
    torch.testing.assert_close(ns.params["w"], params()["w"])


def test_sync_duplicate_and_stale_contributions_are_not_applied() -> None:
    store, client = ready_store(mode="sync", num_workers=1)
    assert client.push(good_grads(), 0, step=0)[0].applied
    stale = client.push(good_grads(), 0, step=0)[0]
    assert not stale.applied and "already applied" in stale.note
    assert store.namespace("ns").global_step == 1


def test_sync_staleness_bound_lets_a_worker_run_ahead_by_at_most_n() -> None:
    store, _ = ready_store(mode="sync", num_workers=2, staleness=2)
    fast = connect(store)
    for step in range(2):  # steps 0 and 1 return although worker 1 has not pushed
        reply = fast.push(good_grads(), 0, step=step)[0]
        assert reply.applied and reply.info.global_step == 0
    blocked = threading.Thread(target=lambda: fast.push(good_grads(), 0, step=2))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive(), "step 2 must wait: it is 3 ahead of the global step"
    connect(store).push(good_grads(), 1, step=0)
    blocked.join(5)
    assert not blocked.is_alive()
    assert store.namespace("ns").global_step == 1


def test_async_staleness_bound_blocks_the_fast_worker() -> None:
    # Like sync mode: a worker may start update k while the slowest has done k - N.
    store, client = ready_store(mode="async", num_workers=2, staleness=1)
    client.push(good_grads(), 0)
    client.push(good_grads(), 0)
    blocked = threading.Thread(target=lambda: client.push(good_grads(), 0))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()
    connect(store).push(good_grads(), 1)
    blocked.join(5)
    assert not blocked.is_alive()
    assert store.namespace("ns").global_step == 4


def test_every_wait_ends_at_the_store_bound_even_without_a_caller_deadline() -> None:
    store = ParameterStore(max_wait=0.2)
    client = connect(store)
    client.init(params(), SGD, mode="sync", num_workers=2, staleness_bound=None,
                fingerprint=FP)
    ended: list[object] = []
    waiting = threading.Thread(target=lambda: ended.append(
        store.push(iter(push_frames(good_grads(), worker=0, step=0)))), daemon=True)
    waiting.start()
    waiting.join(5)  # worker 1 never pushes: the wait ends at max_wait
    assert ended and "not complete" in ended[0].note  # type: ignore[attr-defined]
    request = pb.PullRequest(namespace="ns", min_step=5)
    pulled = threading.Thread(target=lambda: ended.append(list(store.pull(request))), daemon=True)
    pulled.start()
    pulled.join(5)  # step 5 never comes: the pull answers with the current state
    assert len(ended) == 2
    # The contribution was kept: worker 1 completes the step.
    assert client.push(good_grads(), 1, step=0)[0].info.global_step == 1


def test_an_async_push_at_the_target_does_not_wait_for_a_worker_that_stopped() -> None:
    store = ParameterStore()
    client = connect(store)
    client.init(params(), SGD, mode="async", num_workers=2, staleness_bound=1,
                fingerprint=FP, target_steps=2)
    client.push(good_grads(), 1)
    client.push(good_grads(), 1)  # the target: worker 0 stops without pushing again
    replies: list[pb.PushReply] = []
    ahead = threading.Thread(target=lambda: replies.extend(client.push(good_grads(), 1)),
                             daemon=True)
    ahead.start()
    ahead.join(5)
    store.stop()  # ends the wait, if any, of a failing run
    assert replies and not replies[0].applied and "target" in replies[0].note


def test_namespaces_do_not_clash() -> None:
    store = ParameterStore()
    a, b = connect(store, "job-a"), connect(store, "job-b")
    a.init(params(), SGD, mode="async", num_workers=1, staleness_bound=None, fingerprint=FP)
    other = {k: v * 10 for k, v in params().items()}
    b.init(other, SGD, mode="async", num_workers=1, staleness_bound=None, fingerprint="cd" * 32)
    a.push(good_grads())
    out = {k: torch.empty_like(v) for k, v in params().items()}
    assert b.pull(out) == 0
    torch.testing.assert_close(out["w"], other["w"])
    assert a.info(0).global_step == 1


def test_init_with_another_model_in_the_same_namespace_is_refused() -> None:
    store, client = ready_store()
    before = snapshot(store)
    with pytest.raises(PSError, match="already holds a different model") as err:
        client.init(params(), SGD, mode="async", num_workers=1, staleness_bound=None,
                    fingerprint="ef" * 32)
    assert err.value.code == "FAILED_PRECONDITION"
    assert same(snapshot(store), before)


def test_init_rejects_nan_parameters_and_bad_settings() -> None:
    store = ParameterStore()
    client = connect(store)
    bad = params()
    bad["b"][0] = float("nan")
    with pytest.raises(PSError, match="parameter 'b' contains NaN or inf"):
        client.init(bad, SGD, mode="async", num_workers=1, staleness_bound=None, fingerprint=FP)
    with pytest.raises(PSError, match="mode is 'nope'"):
        client.init(params(), SGD, mode="nope", num_workers=1, staleness_bound=None,
                    fingerprint=FP)
    assert not client.info(0).initialized


@pytest.mark.parametrize("config, message", [
    (OptimizerConfig(name="sgd", learning_rate=float("inf")),
     "init: optimizer.learning_rate is inf; it must be a finite number"),
    (OptimizerConfig(name="sgd", learning_rate=0.1, weight_decay=float("nan")),
     "init: optimizer.weight_decay is nan; it must be a finite number"),
    (OptimizerConfig(name="adam", learning_rate=0.1, beta2=1.0),
     "init: optimizer.beta2 is 1.0; it must be less than 1"),
    (OptimizerConfig(name="adagrad", learning_rate=0.1, eps=0.0),
     "init: optimizer.eps is 0.0; it must be greater than 0"),
    (OptimizerConfig(name="momentum", learning_rate=0.1, momentum=-0.5),
     "init: optimizer.momentum is -0.5; it must be greater than or equal to 0"),
], ids=["inf-lr", "nan-decay", "beta2-1", "eps-0", "negative-momentum"])
def test_init_refuses_hyperparameters_outside_the_apis_bounds(
        config: OptimizerConfig, message: str) -> None:
    """Issue 26.3: the server refuses them as it refuses wrong sizes, and whatever the
    namespace held stays."""
    store, client = ready_store()
    before = snapshot(store)
    with pytest.raises(PSError) as err:
        client.init(params(), config, mode="async", num_workers=1, staleness_bound=None,
                    fingerprint=FP)
    assert err.value.code == "INVALID_ARGUMENT"
    assert err.value.message == message
    assert same(snapshot(store), before)
    fresh = connect(ParameterStore())
    with pytest.raises(PSError, match="it must be"):
        fresh.init(params(), config, mode="async", num_workers=1, staleness_bound=None,
                   fingerprint=FP)
    assert not fresh.info(0).initialized


def test_finish_tells_workers_the_job_is_done() -> None:
    store, client = ready_store(num_workers=2)
    client.finish()
    reply = connect(store).push(good_grads(), worker=1)[0]
    assert reply.info.done and not reply.applied
    assert store.workers_informed()


def test_pull_state_returns_parameters_and_optimizer_slots() -> None:
    store, client = ready_store(config=OptimizerConfig(name="adam", learning_rate=0.1))
    client.push(good_grads())
    state = client.pull_state()
    assert state.global_step == 1
    assert sorted(state.slots["w"]) == ["exp_avg", "exp_avg_sq"]
    assert state.slot_steps == {"b": 1, "w": 1}
    torch.testing.assert_close(state.params["w"], store.namespace("ns").params["w"])


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_pull_state_at_a_checkpoint_step_gets_the_shard_as_it_was_then(mode: str) -> None:
    """The chief asks for step 2 after more pushes landed: it gets step 2's parameters
    and optimizer state, not the newer ones; a step with no copy gets the live state."""
    store = ParameterStore()
    client = connect(store)
    client.init(params(), OptimizerConfig(name="adam", learning_rate=0.1), mode=mode,
                num_workers=1, staleness_bound=None, fingerprint=FP, checkpoint_every=2)
    for step in range(2):
        client.push(good_grads(), step=step) if mode == "sync" else client.push(good_grads())
    at_two = snapshot(store)
    client.push(good_grads(), step=2) if mode == "sync" else client.push(good_grads())
    state = client.pull_state(at_step=2)
    assert state.global_step == 2 and state.slot_steps == {"b": 2, "w": 2}
    torch.testing.assert_close(state.params["w"], at_two[1]["w"])
    torch.testing.assert_close(state.slots["w"]["exp_avg"], at_two[2]["w"][1]["exp_avg"])
    assert client.pull_state(at_step=1).global_step == 3


def test_bfloat16_gradients_on_the_wire_update_float32_parameters() -> None:
    store, _ = ready_store()
    p = params()
    placement = build_placement(param_specs({n: t.shape for n, t in p.items()}), 1)
    client = ShardedClient([LocalTransport(store)], placement, "ns", wire_dtype=torch.bfloat16)
    grads = {"b": torch.full((4,), 0.1), "w": torch.full((3, 4), 0.3)}
    client.push(grads)
    ns = store.namespace("ns")
    assert ns.params["w"].dtype == torch.float32
    expected = p["w"] - 0.5 * grads["w"].to(torch.bfloat16).float()
    torch.testing.assert_close(ns.params["w"], expected)


# ---------------------------------------------------------------- fused push + pull
def _fused_stream(store: ParameterStore, frames: list[bytes]) -> list[bytes]:
    return list(store.push_pull(iter(frames)))


def _fused_small(store: ParameterStore, frames: list[bytes]) -> list[bytes]:
    return [bytes(f) for f in wire.decode_batch(store.push_pull_small(wire.encode_batch(
        iter(frames))))]


FUSED = {"stream": _fused_stream, "small": _fused_small}


@pytest.mark.parametrize("fused", FUSED.values(), ids=FUSED.keys())
@pytest.mark.parametrize(("frames", "code", "message"), BAD_PUSHES.values(), ids=BAD_PUSHES.keys())
def test_bad_push_pull_is_refused_and_changes_nothing(fused, frames, code, message) -> None:
    store, _ = ready_store()
    before = snapshot(store)
    with pytest.raises(PSError, match=message) as err:
        fused(store, frames())
    assert err.value.code == code
    assert same(snapshot(store), before)


@pytest.mark.parametrize("batch", [b"\x12\x00", b"\x0a\x05abc", b"\x0a\xff"],
                         ids=["wrong-tag", "short-frame", "cut-length"])
def test_corrupt_frame_batch_is_refused(batch: bytes) -> None:
    store, _ = ready_store()
    before = snapshot(store)
    with pytest.raises(PSError, match="frame batch") as err:
        store.push_pull_small(batch)
    assert err.value.code == "INVALID_ARGUMENT"
    assert same(snapshot(store), before)


@pytest.mark.parametrize("small_bytes", [0, wire.CHUNK_BYTES], ids=["stream", "small"])
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_push_pull_equals_push_then_pull(mode: str, small_bytes: int) -> None:
    fused_store, fused = ready_store(mode)
    plain_store, plain = ready_store(mode)
    fused.small_bytes = small_bytes
    got = {n: torch.zeros_like(t) for n, t in params().items()}
    want = {n: torch.zeros_like(t) for n, t in params().items()}
    for step in range(3):
        grads = {n: torch.full_like(t, 0.1 * (step + 1)) for n, t in params().items()}
        replies = fused.push_pull(grads, got, step=step)
        plain_replies = plain.push(grads, step=step)
        plain.pull(want)
        assert [r.applied for r in replies] == [r.applied for r in plain_replies] == [True]
        assert replies[0].info.global_step == step + 1
        assert fused.last_pull_steps == plain.last_pull_steps == [step + 1]
        for name in want:
            assert torch.equal(got[name], want[name]), name
    assert same(snapshot(fused_store), snapshot(plain_store))


def test_push_pull_after_done_pulls_and_reports_done() -> None:
    store, client = ready_store()
    store.finish("ns")
    out = {n: torch.zeros_like(t) for n, t in params().items()}
    replies = client.push_pull(good_grads(), out)
    assert replies[0].info.done and not replies[0].applied
    assert torch.equal(out["w"], params()["w"])


# ---------------------------------------------------------------- gradients in one buffer
MOMENTUM = OptimizerConfig(name="momentum", learning_rate=0.5, momentum=0.9)


def _reference_after(pushes: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The parameters after applying `pushes` one tensor at a time (the per-tensor path)."""
    from pstrain_runtime.optim import apply_gradient, init_state

    ref = params()
    states = {k: init_state(MOMENTUM, v) for k, v in ref.items()}
    for grads in pushes:
        for key, grad in grads.items():
            apply_gradient(MOMENTUM, ref[key], grad.float(), states[key])
    return ref


PUSH_SEQUENCES = {
    # The same pooled buffer serves push after push; a subset or another order is
    # another buffer; a mix of dtypes (or one tensor) uses per-tensor buffers.
    "same-set": [good_grads(), with_value(-3.0), good_grads()],
    "subsets-and-orders": [good_grads(), {"w": torch.full((3, 4), 0.4)},
                           {"w": torch.full((3, 4), -0.1), "b": torch.full((4,), 2.0)},
                           good_grads()],
    "mixed-dtypes": [{"b": torch.full((4,), 0.5).half(), "w": torch.full((3, 4), 0.25)},
                     {"b": torch.full((4,), 0.5).bfloat16(), "w": torch.ones(3, 4).half()},
                     good_grads()],
}


@pytest.mark.parametrize("pushes", PUSH_SEQUENCES.values(), ids=PUSH_SEQUENCES.keys())
def test_async_pushes_equal_the_per_tensor_apply(pushes) -> None:
    store, _ = ready_store(config=MOMENTUM)
    for grads in pushes:
        assert store.push(iter(push_frames(grads))).applied
    ns = store.namespace("ns")
    for key, expected in _reference_after(pushes).items():
        assert torch.equal(ns.params[key], expected), key


NONFINITE = {
    "first-of-two": ({"w": torch.full((3, 4), float("inf")), "b": torch.ones(4)}, "w"),
    "last-of-two": ({"w": torch.ones(3, 4), "b": torch.tensor([0, 0, float("nan"), 0])}, "b"),
    "both": ({"b": torch.full((4,), float("-inf")), "w": torch.full((3, 4), float("nan"))},
             "b"),
    "mixed-dtypes": ({"b": torch.ones(4).half(), "w": with_value(float("nan"))["w"]}, "w"),
    "one-tensor": ({"w": with_value(float("inf"))["w"]}, "w"),
    "overflowing-sum": ({"b": torch.full((4,), 3e38), "w": torch.ones(3, 4)}, None),
}


@pytest.mark.parametrize(("grads", "named"), NONFINITE.values(), ids=NONFINITE.keys())
def test_a_nonfinite_gradient_is_named_and_the_next_push_is_clean(grads, named) -> None:
    store, _ = ready_store(config=MOMENTUM)
    if named is None:  # finite values whose sum overflows: accepted
        assert store.push(iter(push_frames(grads))).applied
        applied = [grads]
    else:
        with pytest.raises(PSError, match=f"gradient '{named}' contains NaN or inf"):
            store.push(iter(push_frames(grads)))
        applied = []
    # The pooled buffers that held the bad values are overwritten by the next push.
    clean = {key: torch.full_like(value, 0.125) for key, value in grads.items()}
    assert store.push(iter(push_frames(clean))).applied
    ns = store.namespace("ns")
    for key, expected in _reference_after([*applied, clean]).items():
        assert torch.equal(ns.params[key], expected), key


def test_sync_buckets_never_hold_views_of_a_reused_buffer() -> None:
    # Sync buckets adopt the first worker's gradients without a copy; the next push
    # must not write over them before the step is applied.
    store, _ = ready_store(mode="sync", num_workers=2, config=MOMENTUM)
    first = {"b": torch.full((4,), 1.0), "w": torch.full((3, 4), 1.0)}
    store.push(iter(push_frames(first, step=0)), timeout=0.01)  # waits for worker 1: times out
    other = {"b": torch.full((4,), 3.0), "w": torch.full((3, 4), -1.0)}
    store.push(iter(push_frames(other, worker=1, step=0)))
    mean = {"b": torch.full((4,), 2.0), "w": torch.zeros(3, 4)}
    ns = store.namespace("ns")
    for key, expected in _reference_after([mean]).items():
        assert torch.equal(ns.params[key], expected), key


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize(("where", "value"), [
    ("first chunk", float("nan")), ("last chunk", float("inf")),
    ("middle chunk", float("-inf")),
])
def test_a_lone_gradient_checked_as_it_arrives_rejects_nan_in_any_chunk(mode, where,
                                                                       value) -> None:
    """A push of one tensor is summed chunk by chunk as it arrives (16-byte chunks here:
    3 chunks for 12 floats); a bad value in any chunk still rejects the whole push."""
    store = ParameterStore()
    client = ShardedClient([LocalTransport(store)],
                           build_placement(param_specs({"w": (3, 4)}), 1), "ns",
                           chunk_bytes=16)
    client.init({"w": params()["w"]}, SGD, mode=mode, num_workers=1, staleness_bound=None,
                fingerprint=FP)
    before = snapshot(store)
    grad = torch.full((3, 4), 0.2)
    grad.view(-1)[{"first chunk": 1, "middle chunk": 6, "last chunk": 11}[where]] = value
    with pytest.raises(PSError, match="gradient 'w' contains NaN or inf"):
        store.push(iter(push_frames({"w": grad})))
    assert same(before, snapshot(store))
    store.push(iter(push_frames({"w": torch.full((3, 4), 0.2)})))
    assert store.namespace("ns").global_step == 1


def test_large_finite_gradients_whose_sum_overflows_are_accepted() -> None:
    """The running sum overflows to inf for values near float32's max; the precise check
    then finds every value finite and the push is applied."""
    store, _ = ready_store()
    grads = {"b": torch.full((4,), 3e38), "w": torch.full((3, 4), 3e38)}
    reply = store.push(iter(push_frames(grads)))
    assert reply.applied and store.namespace("ns").global_step == 1
