"""The replica environment, the exec shim and free ports (no replicas started)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from pstrain_runtime.local.processes import (find_free_ports, replica_environment,
                                             wrap_command)

CLUSTER = {"PSTRAIN_CLUSTER": "{}", "TF_CONFIG": "{}", "PSTRAIN_TRAINING": "{}"}


@pytest.mark.parametrize(
    ("base", "expected_threads"),
    [pytest.param({"PATH": "/bin"}, "2", id="thread-budget-added"),
     pytest.param({"PATH": "/bin", "OMP_NUM_THREADS": "7"}, "7", id="user-setting-kept")],
)
def test_replica_environment(base, expected_threads):
    env = replica_environment(base, CLUSTER, threads=2)
    assert env["PATH"] == "/bin"
    assert {k: env[k] for k in CLUSTER} == CLUSTER
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["OMP_NUM_THREADS"] == expected_threads


def test_cluster_spec_environment_wins_over_the_runners():
    env = replica_environment({"TF_CONFIG": "stale"}, CLUSTER, threads=1)
    assert env["TF_CONFIG"] == "{}"


def test_free_ports_are_distinct_and_bindable():
    ports = find_free_ports(5)
    assert len(set(ports)) == 5
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_shim_execs_the_command_with_its_arguments_and_exit_code():
    done = subprocess.run(
        wrap_command([sys.executable, "-c", "import sys; print(sys.argv[1:]); sys.exit(3)",
                      "a b", "c"]),
        capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout.strip()) == (3, "['a b', 'c']")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_shim_refuses_to_run_when_its_parent_is_already_gone():
    # Parent pid 1 is never this test's pid: the shim must not start the command.
    done = subprocess.run(wrap_command([sys.executable, "-c", "print('ran')"], parent_pid=1),
                          capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (137, "")
