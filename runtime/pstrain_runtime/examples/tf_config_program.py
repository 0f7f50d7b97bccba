"""A parameter-server program written against the TF_CONFIG contract alone, the way an
unmodified TensorFlow program (`tf.distribute.Server` + ParameterServerStrategy) is:

- it takes its role and everyone's address from the TF_CONFIG environment variable;
- parameter servers and non-chief workers serve on their port and never exit by
  themselves (TensorFlow's servers `join()` forever);
- the chief (the `chief` task, or worker 0 when the cluster has none) connects to every
  server, runs the training steps and exits 0.

It needs no TensorFlow and nothing from pstrain: it stands in for such a program in the
example `examples/tf-config-program.yaml` and its test. The "training" is a counter on
each parameter server that the chief adds to once per step, round robin, and checks at
the end.

    python -m pstrain_runtime.examples.tf_config_program [--steps N]
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Mapping

CONNECT_TIMEOUT_S = 60.0


def read_tf_config(environ: Mapping[str, str]) -> tuple[dict[str, list[str]], str, int]:
    """(cluster, task type, task index) from TF_CONFIG; ValueError when unusable."""
    raw = environ.get("TF_CONFIG")
    if not raw:
        raise ValueError("TF_CONFIG is not set; this program runs as a replica of a job")
    try:
        config = json.loads(raw)
        cluster = {str(k): [str(a) for a in v] for k, v in config["cluster"].items()}
        return cluster, str(config["task"]["type"]), int(config["task"]["index"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"TF_CONFIG is not valid: {exc}") from exc


def is_chief(cluster: Mapping[str, list[str]], task_type: str, index: int) -> bool:
    """TensorFlow's rule: the `chief` task, or worker 0 in a cluster without one."""
    if "chief" in cluster:
        return task_type == "chief"
    return task_type == "worker" and index == 0


def bind_host(host: str) -> str:
    """Listen on a loopback address as given (local runs); on every interface otherwise
    (in a pod, the address is a DNS name of the pod's own IP)."""
    try:
        return host if ipaddress.ip_address(host).is_loopback else "0.0.0.0"
    except ValueError:
        return "0.0.0.0"


class _Handler(socketserver.StreamRequestHandler):
    """One line per request: `add N` adds to the counter and answers the total; any
    other line answers the total."""

    def handle(self) -> None:
        server: CounterServer = self.server  # type: ignore[assignment]
        for raw in self.rfile:
            words = raw.decode().split()
            with server.lock:
                if len(words) == 2 and words[0] == "add":
                    server.total += int(words[1])
                total = server.total
            self.wfile.write(f"{total}\n".encode())


class CounterServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int]):
        super().__init__(address, _Handler)
        self.lock = threading.Lock()
        self.total = 0


def serve(address: str) -> None:
    """Serve on `address` until the process is stopped, like `tf.distribute.Server`."""
    host, _, port = address.rpartition(":")
    with CounterServer((bind_host(host), int(port))) as server:
        print(f"serving on {address}", flush=True)
        server.serve_forever()


def connect(address: str, deadline: float) -> socket.socket:
    """A connection to `address`, retried until `deadline` (servers may still start)."""
    host, _, port = address.rpartition(":")
    while True:
        try:
            return socket.create_connection((host, int(port)), timeout=5.0)
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


def ask(conn: socket.socket, line: str) -> int:
    conn.sendall(f"{line}\n".encode())
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        reply += chunk
    return int(reply)


def coordinate(cluster: Mapping[str, list[str]], steps: int) -> int:
    """The chief: reach every server, add 1 to one PS per step, check the totals."""
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    ps = [connect(a, deadline) for a in cluster.get("ps", [])]
    workers = list(cluster.get("worker", []))
    servers = workers if "chief" in cluster else workers[1:]  # every worker but itself
    for address in servers:
        connect(address, deadline).close()
    print(f"connected to {len(ps)} parameter server(s) and {len(servers)} worker(s)",
          flush=True)
    for step in range(steps):
        ask(ps[step % len(ps)], "add 1")
    totals = [ask(conn, "get") for conn in ps]
    for conn in ps:
        conn.close()
    print(f"trained {steps} steps; parameter server totals {totals}", flush=True)
    return 0 if sum(totals) == steps else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    try:
        cluster, task_type, index = read_tf_config(os.environ)
    except ValueError as exc:
        print(f"tf_config_program: {exc}", file=sys.stderr)
        return 2
    print(f"TF_CONFIG says: {task_type} {index} of {json.dumps(cluster)}", flush=True)
    if is_chief(cluster, task_type, index):
        return coordinate(cluster, args.steps)
    serve(cluster[task_type][index])
    return 0


if __name__ == "__main__":
    sys.exit(main())
