"""glibc malloc settings per role (`pstrain_runtime.allocator`), each in a fresh process:
they change the process for good."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or "libc.so" not in (ctypes.util.find_library("c") or ""),
    reason="glibc only")

# Eight threads hold small blocks at once (each would get an arena of its own), then
# malloc_stats() writes one "Arena N:" line per arena to stderr.
PROGRAM = textwrap.dedent("""
    import ctypes, sys, threading
    from pstrain_runtime import allocator
    role = sys.argv[1]
    print("tuned", allocator.tune(role) if role != "-" else None, flush=True)
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    barrier = threading.Barrier(8)
    def work():
        barrier.wait()
        blocks = [libc.malloc(1000) for _ in range(100)]
        barrier.wait()
        for block in blocks:
            libc.free(block)
    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    libc.malloc_stats()
""")


def _run(role: str, **env: str) -> tuple[str, int]:
    """(what tune returned, the arenas malloc had at the end)."""
    done = subprocess.run([sys.executable, "-c", PROGRAM, role], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    arenas = sum(line.startswith("Arena ") for line in done.stderr.splitlines())
    return done.stdout.split()[-1], arenas


@pytest.mark.parametrize("role", ["trainer", "ps", "budget"])
def test_every_setting_of_a_role_is_taken(role):
    assert _run(role)[0] == "True"  # mallopt accepted each parameter


def test_a_server_uses_one_arena_for_all_its_threads():
    assert _run("ps") == ("True", 1)
    # without it (glibc's default, and a trainer's settings) the threads spread out
    assert _run("-")[1] > 1
    assert _run("trainer")[1] > 1


def test_default_leaves_glibc_alone():
    assert _run("ps", PSTRAIN_MALLOC="default")[0] == "False"
    assert _run("ps", PSTRAIN_MALLOC="default")[1] > 1
