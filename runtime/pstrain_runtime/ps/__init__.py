"""The parameter server's side, without sockets: one module per concern.

- `namespace`: one namespace's state, the record every concern below reads and writes.
- `shard`: the dense shard: its tensors, Init (and restore), applying gradients.
- `pull`: the dense shard (or a kept snapshot) streamed back.
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

`pstrain_runtime.store.ParameterStore` is the facade the servers call.
"""
