"""The worker side of the runtime: one trainer process, from joining the job to its end.

Where things live:
- `trainer`: `Trainer`, which builds the parts below and runs them as a short script.
- `client`: talking to the parameter servers: one server (`Transport`: TCP, gRPC or in
  process) and the whole sharded model (`ShardedClient`).
- `placement`: which server holds which parameter (or which rows of it), a pure function
  every worker computes alike.
- `context`: what every part shares (settings, role, model, client, the newest step).
- `parameters`: the model's parameters and the CPU tensors the transport reads and writes.
- `loop`: the worker's step loop (pull, compute, push, until the target step), and how
  it reacts to a refused or failed call.
- `step`: one step's backward and push (plain, overlapped with backward);
  `pipeline`: async pipelining (a push in flight while the next step computes).
- `data`: where this worker's batches resume, and their re-partition on a resize.
- `membership`: joining and leaving the job's worker set (elastic workers).
- `sparse_binding`: the binding of a model's sparse tables to the step and the chief.
- `chief/`: the chief's duties: initialising and restoring the servers, the checkpoint
  schedule, evaluation, progress and status, and the end of the job.

Like the package above, importing this one is cheap: the modules that need torch are
imported by whoever uses them.
"""

__all__: list[str] = []
