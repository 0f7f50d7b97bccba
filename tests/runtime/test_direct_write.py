"""direct_write.DirectFile through checkpoint.write_atomically(direct=True): the bytes
written are the file, to the byte, at every size around the alignment and staging
boundaries, with O_DIRECT and without it (a file system that refuses it, a write
refused with it, a short write), and a failing write leaves no file behind."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from pstrain_runtime import direct_write
from pstrain_runtime.checkpoint import write_atomically
from pstrain_runtime.direct_write import ALIGN, STAGE, DirectFile

SIZES = [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, STAGE - 1, STAGE, STAGE + 1, 2 * STAGE + 17]


def pieces(seed: int, sizes: list[int]) -> list[bytes | np.ndarray]:
    """Bytes and uint8/float32 arrays, alternately, of the given byte sizes."""
    rng = np.random.default_rng(seed)
    out: list[bytes | np.ndarray] = []
    for k, size in enumerate(sizes):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        if k % 3 == 0:
            out.append(data.tobytes())
        elif k % 3 == 1 or size % 4:
            out.append(data)
        else:
            out.append(data.view(np.float32).reshape(-1, 1))  # any dtype, any shape
    return out


def as_bytes(piece: bytes | np.ndarray) -> bytes:
    return piece if isinstance(piece, bytes) else piece.tobytes()


def write(path: Path, parts: list[bytes | np.ndarray]) -> DirectFile:
    def go(fh: DirectFile) -> DirectFile:
        for part in parts:
            fh.write(part)
        return fh
    return write_atomically(path, go, direct=True)


@pytest.mark.parametrize("size", SIZES)
def test_one_write_of_each_size_is_the_file(tmp_path, size):
    parts = pieces(size, [size])
    fh = write(tmp_path / "f", parts)
    assert (tmp_path / "f").read_bytes() == as_bytes(parts[0])
    assert fh.size == size


def test_many_writes_across_the_stage_boundaries(tmp_path):
    sizes = [7, ALIGN, STAGE - 3, 1, 0, STAGE + ALIGN, 12345, ALIGN - 1]
    parts = pieces(1, sizes)
    fh = write(tmp_path / "f", parts)
    assert (tmp_path / "f").read_bytes() == b"".join(map(as_bytes, parts))
    assert fh.size == sum(sizes)
    assert not [p for p in tmp_path.iterdir() if p.name != "f"]  # no temporary left


def takes_direct(directory: Path) -> bool:
    """Whether `directory`'s file system takes O_DIRECT (ext4 and xfs do, tmpfs not)."""
    fd = os.open(directory / "probe", os.O_WRONLY | os.O_CREAT)
    try:
        return DirectFile(fd).direct
    finally:
        os.close(fd)
        os.unlink(directory / "probe")


def test_o_direct_is_used_where_the_file_system_takes_it(tmp_path):
    if not takes_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s file system takes no O_DIRECT")
    fh = write(tmp_path / "f", pieces(2, [STAGE + 5]))
    assert fh.direct  # the whole file went around the page cache, tail included


def test_a_file_system_without_o_direct_gets_the_same_bytes(tmp_path, monkeypatch):
    real = direct_write.fcntl.fcntl

    def refuse(fd, cmd, arg=0):
        if cmd == direct_write.fcntl.F_SETFL and arg & direct_write.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # as tmpfs answers
        return real(fd, cmd, arg)

    monkeypatch.setattr(direct_write.fcntl, "fcntl", refuse)
    parts = pieces(3, [STAGE + 3, 10])
    fh = write(tmp_path / "f", parts)
    assert not fh.direct
    assert (tmp_path / "f").read_bytes() == b"".join(map(as_bytes, parts))


@pytest.mark.parametrize("when", [0, 1, 2], ids=["first-write", "second-write", "tail"])
def test_a_write_refused_with_o_direct_goes_on_through_the_page_cache(tmp_path, monkeypatch,
                                                                       when):
    if not takes_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s file system takes no O_DIRECT")
    real, calls = os.write, []

    def once_refused(fd, data):
        calls.append(len(data))
        if len(calls) == when + 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data)

    monkeypatch.setattr(direct_write.os, "write", once_refused)
    parts = pieces(4, [2 * STAGE + 100])
    fh = write(tmp_path / "f", parts)
    assert (tmp_path / "f").read_bytes() == as_bytes(parts[0])  # no padding left behind
    assert len(calls) == 4 and not fh.direct


@pytest.mark.parametrize("written", [ALIGN, ALIGN + 3], ids=["aligned", "unaligned"])
def test_a_short_write_is_followed_by_the_rest(tmp_path, monkeypatch, written):
    """A write that takes fewer bytes than given: the rest follows, with O_DIRECT while
    the offset stays aligned, through the page cache once it cannot."""
    if not takes_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s file system takes no O_DIRECT")
    real, short = os.write, []

    def short_once(fd, data):
        if short:
            return real(fd, data)
        short.append(fd)
        if written % ALIGN:  # only a buffered write can end off a block
            flags = direct_write.fcntl.fcntl(fd, direct_write.fcntl.F_GETFL)
            direct_write.fcntl.fcntl(fd, direct_write.fcntl.F_SETFL,
                                     flags & ~direct_write.O_DIRECT)
        return real(fd, data[:written])

    monkeypatch.setattr(direct_write.os, "write", short_once)
    parts = pieces(5, [STAGE + 9])
    fh = write(tmp_path / "f", parts)
    assert (tmp_path / "f").read_bytes() == as_bytes(parts[0])
    assert fh.direct == (written % ALIGN == 0)


def test_a_failing_write_raises_and_leaves_no_file(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_write.os, "write", full)
    with pytest.raises(OSError, match="No space"):
        write(tmp_path / "f", pieces(6, [STAGE + 1]))
    assert list(tmp_path.iterdir()) == []


def claimed(path: Path, steps: list[tuple[str, int]], seed: int) -> tuple[DirectFile, bytes]:
    """Write `steps` ("write" n bytes, or "claim" n bytes then fill them) to `path`;
    the file and the bytes it should hold."""
    rng = np.random.default_rng(seed)
    expected: list[bytes] = []

    def go(fh: DirectFile) -> DirectFile:
        for kind, size in steps:
            data = rng.integers(0, 256, size, dtype=np.uint8)
            if kind == "write":
                fh.write(data)
            else:
                room = fh.claim(size)
                assert room.shape == (size,) and room.dtype == np.uint8
                room[:] = data
            expected.append(data.tobytes())
        return fh

    return write_atomically(path, go, direct=True), b"".join(expected)


@pytest.mark.parametrize("steps", [
    [("claim", 0), ("claim", 1), ("claim", direct_write.ROOM)],
    [("write", 7), ("claim", direct_write.ROOM), ("claim", direct_write.ROOM)],
    [("claim", ALIGN + 5), ("write", STAGE - 3), ("claim", 9), ("write", 2 * STAGE + 1),
     ("claim", direct_write.ROOM - 1), ("claim", 3), ("write", ALIGN)],
    [("claim", 1000)] * 40 + [("write", 1)] + [("claim", 4095)] * 2100,
], ids=["sizes", "full-rooms", "mixed", "many"])
def test_claimed_room_is_the_file_in_order_with_writes(tmp_path, steps):
    """Bytes filled into claimed room land where they fall among the writes, across
    every boundary of the buffer (what is staged past its last whole block carried to
    its start)."""
    fh, expected = claimed(tmp_path / "f", steps, len(steps))
    assert (tmp_path / "f").read_bytes() == expected
    assert fh.size == len(expected)


def test_claimed_room_without_o_direct_is_the_same_file(tmp_path, monkeypatch):
    monkeypatch.setattr(direct_write, "O_DIRECT", 0)
    steps = [("write", 11), ("claim", direct_write.ROOM), ("claim", 5), ("write", STAGE)]
    fh, expected = claimed(tmp_path / "f", steps, 7)
    assert not fh.direct
    assert (tmp_path / "f").read_bytes() == expected


@pytest.mark.parametrize("size", [direct_write.ROOM + 1, STAGE])
def test_a_claim_larger_than_the_room_is_refused(tmp_path, size):
    with pytest.raises(ValueError, match=f"a claim is 0 to {direct_write.ROOM} bytes"):
        claimed(tmp_path / "f", [("write", 3), ("claim", size)], 8)
    assert list(tmp_path.iterdir()) == []
