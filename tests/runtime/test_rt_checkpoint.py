"""Checkpoints: round trip, atomic writes, retention, and clear refusals of corrupt or
mismatched files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pstrain_runtime.checkpoint import (
    Checkpoint,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointStore,
    NoUsableCheckpoint,
    load_checkpoint,
    model_fingerprint,
)
from pstrain_runtime.failure import ConfigurationError


def make_ckpt(step: int = 7) -> Checkpoint:
    params = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    return Checkpoint(
        global_step=step, fingerprint=model_fingerprint(params), optimizer="adam",
        params=params,
        slots={n: {"exp_avg": torch.randn_like(t), "exp_avg_sq": torch.rand_like(t)}
               for n, t in params.items()},
        slot_steps={"w": step, "b": step}, wall_time=1.5)


def test_round_trip_keeps_everything(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    original = make_ckpt()
    path = store.save(original)
    assert path.name == "ckpt-000000000007.pt"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind
    loaded = load_checkpoint(path)
    assert (loaded.global_step, loaded.fingerprint, loaded.optimizer, loaded.slot_steps,
            loaded.wall_time) == (7, original.fingerprint, "adam", {"w": 7, "b": 7}, 1.5)
    for name, tensor in original.params.items():
        assert torch.equal(loaded.params[name], tensor)
        for slot, value in original.slots[name].items():
            assert torch.equal(loaded.slots[name][slot], value)


def test_keeps_only_the_newest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for step in (10, 20, 30):
        store.save(make_ckpt(step))
    assert store.steps() == [20, 30]
    found = store.latest()
    assert found is not None and found[0].global_step == 30 and found[2] == []


def test_fingerprint_ignores_order_but_not_shapes() -> None:
    a = {"x": torch.zeros(2, 3), "y": torch.zeros(3)}
    assert model_fingerprint(a) == model_fingerprint(dict(reversed(a.items())))
    assert model_fingerprint(a) != model_fingerprint({"x": torch.zeros(3, 2), "y": torch.zeros(3)})


@pytest.mark.parametrize(
    ("content", "message"),
    [
        pytest.param(b"not a checkpoint at all", "is corrupt or unreadable", id="garbage"),
        pytest.param(None, "is corrupt or unreadable", id="truncated"),
        pytest.param({"format": "other"}, "is not a pstrain checkpoint", id="foreign-dict"),
        pytest.param({"format": "pstrain-checkpoint", "version": 99}, "format version 99",
                     id="future-version"),
        pytest.param({"format": "pstrain-checkpoint", "version": 1}, "missing or has malformed",
                     id="missing-fields"),
    ],
)
def test_bad_files_are_refused_clearly(tmp_path: Path, content, message) -> None:
    path = tmp_path / "ckpt-000000000005.pt"
    if content is None:
        CheckpointStore(tmp_path).save(make_ckpt(5))
        path.write_bytes(path.read_bytes()[:100])
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path)


def test_latest_falls_back_past_a_corrupt_newest_file(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(make_ckpt(10))
    store.path_for(20).write_bytes(b"junk")
    found = store.latest()
    assert found is not None
    ckpt, path, problems = found
    assert ckpt.global_step == 10 and path == store.path_for(10)
    assert len(problems) == 1 and "ckpt-000000000020.pt is corrupt" in problems[0]


def test_no_usable_checkpoint_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.path_for(10).write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        store.latest()
    assert CheckpointStore(tmp_path / "empty").latest() is None


def test_mismatched_model_or_optimizer_is_refused() -> None:
    ckpt = make_ckpt()
    with pytest.raises(CheckpointError, match="written for a different model"):
        ckpt.check_matches("0" * 64, "adam", "ckpt")
    with pytest.raises(CheckpointError, match="holds adam optimizer state, but the job uses sgd"):
        ckpt.check_matches(ckpt.fingerprint, "sgd", "ckpt")


# ---------------------------------------------------------------------- damage (issue 27.5)


def flip_a_tensor_byte(path: Path, tensor: torch.Tensor) -> None:
    """Change one byte inside `tensor`'s data in the file, as a bad disk would: torch
    still loads it (it does not check its CRC), with a wrong number."""
    data = bytearray(path.read_bytes())
    at = data.find(tensor.numpy().tobytes())
    assert at > 0
    data[at + 5] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_flipped_byte_is_found_by_the_crc(tmp_path: Path) -> None:
    original = make_ckpt(10)
    path = CheckpointStore(tmp_path).save(original)
    flip_a_tensor_byte(path, original.params["w"])
    with pytest.raises(CheckpointCorrupt, match="its tensors do not match the CRC-32"):
        load_checkpoint(path)


def test_a_parameter_holding_nan_is_damage(tmp_path: Path) -> None:
    ckpt = make_ckpt(10)
    ckpt.params["b"][1] = float("nan")
    path = CheckpointStore(tmp_path).save(ckpt)  # its CRC matches: NaN was written
    with pytest.raises(CheckpointCorrupt, match="parameter 'b' holds NaN or inf"):
        load_checkpoint(path)


def test_latest_restores_the_previous_intact_checkpoint_and_names_the_damaged(
        tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(make_ckpt(10))
    newest = make_ckpt(20)
    store.save(newest)
    flip_a_tensor_byte(store.path_for(20), newest.params["w"])
    found = store.latest()
    assert found is not None
    ckpt, path, problems = found
    assert (ckpt.global_step, path) == (10, store.path_for(10))
    assert problems == [f"checkpoint {store.path_for(20)} is corrupt: its tensors do not "
                        "match the CRC-32 written with them"]


def test_every_checkpoint_damaged_is_a_configuration_error(tmp_path: Path) -> None:
    """A restart reads the same bytes: the job must fail at once (no restarts)."""
    store = CheckpointStore(tmp_path)
    store.path_for(10).write_bytes(b"junk")
    newest = make_ckpt(20)
    store.save(newest)
    flip_a_tensor_byte(store.path_for(20), newest.params["b"])
    with pytest.raises(NoUsableCheckpoint) as caught:
        store.latest()
    assert isinstance(caught.value, ConfigurationError)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"no usable checkpoint: checkpoint {store.path_for(20)} is "
                              "corrupt: its tensors do not match the CRC-32")
    assert f"checkpoint {store.path_for(10)} is corrupt or unreadable" in message
    assert message.endswith(f"remove them from {tmp_path} to start afresh, or point "
                            "checkpoint.directory at intact ones")


def test_a_read_that_fails_is_not_taken_for_damage(tmp_path: Path, monkeypatch) -> None:
    store = CheckpointStore(tmp_path)
    store.save(make_ckpt(10))

    def failing_load(*args: object, **kwargs: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(torch, "load", failing_load)
    with pytest.raises(CheckpointError, match="could not be read") as caught:
        store.latest()
    assert not isinstance(caught.value, ConfigurationError)  # a restart may read it
