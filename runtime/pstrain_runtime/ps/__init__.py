"""The parameter server's side: its process edge, and its state and rules without sockets,
one module per concern.

- `server`: the process edge: the grpcio server (control calls, the tensor streams, the
  health service) around a `ParameterStore`, with the TCP data plane beside it.
- `store`: `ParameterStore`, the facade every server calls (gRPC, the data plane, the
  in-process transport); it routes each call to the module below that owns its concern.
- `namespace`: one namespace's state, the record every concern below reads and writes.
- `shard`: the dense shard: its tensors, Init (and restore), applying gradients.
- `pull`: the dense shard (or a kept snapshot) streamed back.
- `snapshots`: copies of the shard taken at checkpoint steps, for the chief to read.
- `grads`: a push's gradients: checked, read into pooled scratch buffers, NaN/inf-free.
- `async_steps`: async mode: a push is applied as it arrives, within the staleness bound.
- `sync_barrier`: sync mode: per-step buckets, applied once every worker contributed.
- `membership`: who may push: the worker set, SetWorkers, where a worker joins,
  generations.
- `job_board`: what the job reports and is asked: reports, job status, checkpoint
  requests, finish.
- `waits`: the bounded wait every blocking call uses (every wait ends).
- `streams`: reading a tensor stream's header and body.
- `errors`: `PSError`, the refusal every part raises.

How tensors and credentials travel is `pstrain_runtime.transport`'s; the optimizers'
arithmetic is `pstrain_runtime.optim`, shared with the workers.
"""
