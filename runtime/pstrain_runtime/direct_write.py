"""Writing a large file around the page cache (O_DIRECT), for checkpoint rows.

A buffered write copies every byte into the kernel's page cache, whose pages it first
allocates, and leaves them to be flushed later: for a checkpoint that streams tens of
megabytes every few seconds, that copy was the largest share of what checkpoints cost
the training that runs beside them (bench/RESULTS.md, session 22). With O_DIRECT the
device reads the bytes from this process's memory; the only copy is into an aligned
staging buffer here, a plain memcpy.

A caller may also fill the staging buffer itself (`claim`: room for the file's next
bytes), so that rows gathered from a table are copied once, into the buffer, not into
new tensors and then into the buffer (bench/RESULTS.md, session 31).

O_DIRECT needs the buffer, the file offset and each write's length aligned (`ALIGN`):
the staging buffer is aligned, every write but the last is whole blocks of ALIGN (what
is staged past the last whole block waits at the buffer's start for the next), the last
is padded with zeros and the file cut back to its true size. Where the file system takes
no O_DIRECT (tmpfs, some network file systems, a platform without it), or refuses a
write with it, the same bytes go through the page cache instead: never an error of
its own.
"""

from __future__ import annotations

import errno
import fcntl
import os

import numpy as np

ALIGN = 4096  # the largest logical block size of common devices
STAGE = 4 << 20  # bytes staged per write (a multiple of ALIGN)
ROOM = STAGE - ALIGN  # the most one `claim` gives
O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none (macOS)


def _aligned(size: int) -> np.ndarray:
    """A uint8 buffer of `size` bytes whose address is a multiple of ALIGN."""
    raw = np.empty(size + ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip:skip + size]


class DirectFile:
    """Write-only file over `fd` (a new, empty file), O_DIRECT where the file system
    takes it. `write` takes bytes or a uint8 array; `finish` writes what is staged,
    gives the file its true size and fsyncs it. The caller closes `fd`."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = 0  # bytes written so far (the file's size once finished)
        self._stage = _aligned(STAGE)
        self._fill = 0
        self.direct = False
        if O_DIRECT:
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | O_DIRECT)
                self.direct = True
            except OSError:  # EINVAL: this file system takes no O_DIRECT
                pass

    def write(self, data: bytes | bytearray | memoryview | np.ndarray) -> int:
        src = (data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray)
               else np.frombuffer(data, dtype=np.uint8))
        pos, total = 0, len(src)
        while pos < total:
            n = min(total - pos, STAGE - self._fill)
            self._stage[self._fill:self._fill + n] = src[pos:pos + n]
            self._fill += n
            pos += n
            if self._fill == STAGE:
                self._drain(STAGE)
        self.size += total
        return total

    def ready(self, size: int) -> None:
        """Write what is staged now if the next `size` bytes (at most ROOM) would not
        fit beside it: a claim of up to `size` bytes then writes nothing (a caller that
        claims while it holds a lock others wait on)."""
        if not 0 <= size <= ROOM:
            raise ValueError(f"a claim is 0 to {ROOM} bytes, not {size}")
        if self._fill + size > STAGE:
            self._drain_blocks()

    def claim(self, size: int) -> np.ndarray:
        """Room for the file's next `size` bytes (at most ROOM), in the staging buffer:
        a uint8 array the caller fills before its next call on this file. Counted as
        written."""
        self.ready(size)
        room = self._stage[self._fill:self._fill + size]
        self._fill += size
        self.size += size
        return room

    def finish(self) -> None:
        if self._fill:
            # O_DIRECT writes whole blocks: pad the tail, then cut the file back.
            length = -(-self._fill // ALIGN) * ALIGN if self.direct else self._fill
            self._stage[self._fill:length] = 0
            self._drain(length)
            os.ftruncate(self.fd, self.size)  # the padding off (even if it went buffered)
        os.fsync(self.fd)

    def _drain_blocks(self) -> None:
        """Write the staged whole blocks; what is staged past them moves to the start."""
        whole = self._fill - self._fill % ALIGN
        tail = self._fill - whole
        self._drain(whole)
        self._stage[:tail] = self._stage[whole:whole + tail]
        self._fill = tail

    def _drain(self, length: int) -> None:
        """Write the first `length` staged bytes at the file's end."""
        view = memoryview(self._stage)[:length]
        done = 0
        while done < length:
            try:
                done += os.write(self.fd, view[done:])
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                self._buffered()  # refused with O_DIRECT: the page cache, then
                continue
            if self.direct and done % ALIGN:  # a short write: the rest cannot align
                self._buffered()
        self._fill = 0

    def _buffered(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~O_DIRECT)
        self.direct = False
