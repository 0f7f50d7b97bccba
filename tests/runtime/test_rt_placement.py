"""Placement: deterministic, balanced by bytes, order-independent, partitions big tensors."""

from __future__ import annotations

import itertools
import random

import pytest

from pstrain_runtime.worker.placement import ParamSpec, Piece, build_placement, param_specs


def specs(**shapes: tuple[int, ...]) -> list[ParamSpec]:
    return param_specs(shapes)


@pytest.mark.parametrize(
    ("params", "num_ps", "partition_bytes", "expected"),
    [
        pytest.param(specs(w=(10, 10)), 1, None, {"w": 0}, id="one-ps-holds-all"),
        pytest.param(specs(a=(100,), b=(60,), c=(50,), d=(10,)), 2, 10**9,
                     {"a": 0, "b": 1, "c": 1, "d": 0}, id="largest-first-to-least-loaded"),
        pytest.param(specs(x=(8,), y=(8,), z=(8,)), 3, None, {"x": 0, "y": 1, "z": 2},
                     id="equal-sizes-tie-broken-by-name-and-index"),
        pytest.param(specs(emb=(1000, 16), bias=(16,)), 2, 32_000, {"bias": 0, "emb": [0, 1]},
                     id="tensor-larger-than-threshold-is-partitioned"),
        pytest.param(specs(emb=(1000, 1000), bias=(1000,)), 2, None,
                     {"bias": 0, "emb": [0, 1]}, id="default-threshold-is-a-fair-share"),
        pytest.param(specs(emb=(1000, 16), bias=(16,)), 2, None, {"bias": 1, "emb": 0},
                     id="small-tensors-are-never-split-by-default"),
        pytest.param(specs(emb=(1000, 16), bias=(16,)), 2, 10**9, {"bias": 1, "emb": 0},
                     id="no-partitioning-under-the-threshold"),
        pytest.param(specs(w=(3, 1000)), 8, 100, {"w": [0, 1, 2]},
                     id="at-most-one-partition-per-row"),
        pytest.param(specs(s=(), v=(4,)), 2, None, {"s": 1, "v": 0}, id="scalars-are-not-split"),
    ],
)
def test_placement_table(params, num_ps, partition_bytes, expected) -> None:
    placement = build_placement(params, num_ps, partition_bytes)
    assert placement.as_table() == expected


def test_placement_is_independent_of_input_order() -> None:
    rng = random.Random(0)
    params = [ParamSpec(f"p{i}", (rng.randint(1, 300), rng.randint(1, 50))) for i in range(12)]
    reference = build_placement(params, 3)
    for perm in itertools.islice(itertools.permutations(params), 0, 200, 7):
        assert build_placement(list(perm), 3) == reference
    shuffled = dict(sorted(((p.name, p.shape) for p in params), key=lambda kv: rng.random()))
    assert build_placement(param_specs(shuffled), 3) == reference


def test_placement_balances_bytes_better_than_round_robin() -> None:
    # Creation order big, small, small, small, big...: round-robin by creation order
    # puts both big tensors on server 0.
    params = specs(a=(1000,), b=(10,), c=(1000,), d=(10,))
    placement = build_placement(params, 2, partition_bytes=10**9)
    assert sorted(placement.loads) == [4040, 4040]


def test_partitions_cover_every_row_once_with_byte_offsets() -> None:
    placement = build_placement(specs(emb=(1001, 8), b=(8,)), 3, partition_bytes=1000)
    pieces = placement.pieces_of("emb")
    assert [(p.row_start, p.row_end) for p in pieces] == [(0, 334), (334, 668), (668, 1001)]
    assert [p.byte_offset for p in pieces] == [0, 334 * 32, 668 * 32]
    assert sorted(p.ps for p in pieces) == [0, 1, 2]
    assert pieces[0] == Piece(param="emb", row_start=0, row_end=334, ps=pieces[0].ps,
                              shape=(334, 8), key="emb/part0", byte_offset=0,
                              nbytes=334 * 32, partitioned=True)


@pytest.mark.parametrize(
    ("params", "num_ps", "message"),
    [
        pytest.param(specs(w=(2,)), 0, "num_ps is 0; it must be at least 1", id="no-ps"),
        pytest.param([ParamSpec("w", (2,)), ParamSpec("w", (3,))], 1, "repeated: ['w']",
                     id="duplicate-names"),
        pytest.param(specs(**{"x/part0": (2,)}), 1, "reserves", id="reserved-name"),
    ],
)
def test_placement_rejects(params, num_ps, message) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_placement(params, num_ps)
