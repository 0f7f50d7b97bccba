"""pstrain runtime: parameter servers, the tensor transport and the training loop.

One room per side, as docs/runtime.md ("Where the code lives") lists them: `ps/` (the
parameter server), `worker/` (a trainer, the chief's duties included), `transport/`
(wire format, data plane, authentication, TLS), `proto/` (the generated gRPC modules),
`sparse/` (sparse embedding tables), `local/` (`pstrain run`). The modules at this level
are the replica's entry (`replica`), the user's contract (`task`) and what several sides
share.

Importing this package must stay cheap and torch-free: the operator image imports
`pstrain_runtime.status_client` (and, through it, the generated proto modules) without
torch installed. Everything that needs torch lives in submodules imported on demand.
"""

__all__: list[str] = []
