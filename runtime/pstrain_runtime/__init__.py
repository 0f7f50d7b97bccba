"""pstrain runtime: parameter servers, the tensor transport and the training loop.

Importing this package must stay cheap and torch-free: the operator image imports
`pstrain_runtime.status_client` (and, through it, the generated proto modules) without
torch installed. Everything that needs torch lives in submodules imported on demand.
"""

__all__: list[str] = []
