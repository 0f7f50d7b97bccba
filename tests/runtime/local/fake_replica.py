"""A fake `pstrain replica` for the local runner's process tests.

It reads its role from PSTRAIN_CLUSTER like the real one, and its behaviour from
FAKE_PLAN (JSON: replica name -> behaviour, "*" for everyone else). Every start is
recorded as one JSON line in $FAKE_STATE_DIR/starts.jsonl.

Behaviour keys (all optional):
  codes:        exit code per attempt, the last one repeating (default [0])
  serve_delay:  PS only: seconds serving NOT_SERVING before SERVING (default 0.2)
  serve:        PS only: false = never serve health at all
  run:          seconds to run before exiting (workers; default 0.1)
  events:       events to print as PSTRAIN_EVENT lines, [[kind, {fields}], ...]
  lines:        plain lines to print
  wait_done:    PS default true: after serving, wait for the chief's done file
  hang:         never exit by itself
  ignore_term:  ignore SIGTERM
  orphan:       leave a child behind that keeps stdout open (pid in orphans.jsonl)
  wait_exit:    [name, attempt]: run until that replica's attempt has exited (by itself)
The chief waits until every other trainer has recorded its start, and writes
$FAKE_STATE_DIR/done before it exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from pstrain_api.cluster import parse_cluster_env
from pstrain_api.events import emit
from pstrain_api.names import replica_name

LIMIT = 60.0  # no fake lives longer than this, whatever happens


def health_of(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2.0)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main() -> int:
    begun = time.monotonic()
    me = parse_cluster_env(os.environ)
    name = replica_name(me.job_name, me.task.role, me.task.index)
    plan_all = json.loads(os.environ.get("FAKE_PLAN", "{}"))
    plan = plan_all.get(name, plan_all.get("*", {}))
    state = Path(os.environ["FAKE_STATE_DIR"])
    starts = state / "starts.jsonl"
    attempt = 1 + sum(1 for line in starts.read_text().splitlines()
                      if json.loads(line)["name"] == name) if starts.exists() else 1
    codes = plan.get("codes", [0])
    code = codes[min(attempt, len(codes)) - 1]

    record = {"name": name, "role": me.task.role, "index": me.task.index,
              "attempt": attempt, "pid": os.getpid(), "time": time.time(),
              "is_chief": me.is_chief,
              "env": {k: os.environ.get(k) for k in
                      ("PSTRAIN_CLUSTER", "TF_CONFIG", "PSTRAIN_TRAINING", "OMP_NUM_THREADS")}}
    auth_dir = os.environ.get("PSTRAIN_AUTH_DIR")
    if auth_dir:  # which key files it was given, and how private they are
        record["auth"] = {"dir": auth_dir, "mode": oct(os.stat(auth_dir).st_mode & 0o777),
                          "keys": sorted(os.listdir(auth_dir))}
    if me.task.role != "ps":
        record["ps_serving"] = [health_of(a) for a in me.addresses("ps")]
    with starts.open("a") as f:
        f.write(json.dumps(record) + "\n")

    if me.is_chief:
        # Like the real chief, do not finish (and so stop the PS) before every other
        # trainer has come up; their records then see the PS still serving.
        others = {replica_name(me.job_name, role, i)
                  for role in ("worker", "chief") for i in range(len(me.addresses(role)))}
        others.discard(name)
        while not others <= {json.loads(x)["name"] for x in starts.read_text().splitlines()}:
            if time.monotonic() - begun > LIMIT:
                return 4
            time.sleep(0.02)

    if plan.get("ignore_term"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for line in plan.get("lines", []):
        print(line, flush=True)

    server = None
    if me.task.role == "ps" and plan.get("serve", True):
        import grpc
        from concurrent import futures
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        server.add_insecure_port(me.addresses("ps")[me.task.index])
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        server.start()
        time.sleep(plan.get("serve_delay", 0.2))
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        print(f"serving attempt {attempt}", flush=True)

    if plan.get("orphan"):
        import subprocess
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        with (state / "orphans.jsonl").open("a") as f:
            f.write(json.dumps(child.pid) + "\n")

    for kind, fields in plan.get("events", []):
        emit(kind, **fields)

    start = time.monotonic()
    if plan.get("hang"):
        while time.monotonic() - start < LIMIT:
            time.sleep(0.05)
        return 3
    if me.task.role == "ps" and plan.get("wait_done", True):
        while not (state / "done").exists():
            if time.monotonic() - start > LIMIT:
                return 4
            time.sleep(0.02)
    elif plan.get("wait_exit"):
        other, other_attempt = plan["wait_exit"]
        exits = state / "exits.jsonl"
        while not (exits.exists() and any(
                json.loads(line) == [other, other_attempt]
                for line in exits.read_text().splitlines())):
            if time.monotonic() - start > LIMIT:
                return 4
            time.sleep(0.02)
    else:
        time.sleep(plan.get("run", 0.1))
    if me.is_chief and code == 0:
        (state / "done").touch()
    if server is not None:
        server.stop(0)
    print(f"exiting with {code}", flush=True)
    with (state / "exits.jsonl").open("a") as f:
        f.write(json.dumps([name, attempt]) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
