"""How calls travel between trainers and parameter servers, both ends of each channel.

- `wire`: tensors as raw little-endian bytes in chunk frames (never pickles): encoding,
  and decoding straight into the destination tensors.
- `dataplane`: the TCP data plane: the tensor calls over plain connections
  (`DataServer` beside each parameter server, `DataClient` in each trainer).
- `admission`: opening data connections (accept, TLS, handshake) in one thread, bounded
  under a flood.
- `auth`: credentials and roles on both channels: gRPC call proofs, the data plane's
  handshake.
- `claims`: which worker a call acts for, and whether its caller may act for it.
- `replay`: the replay cache of the gRPC proofs.
- `tls`: opt-in TLS on both channels.

The gRPC messages and stubs are generated into `pstrain_runtime.proto`. Importing this
package imports nothing: the operator imports `auth` and `tls` without torch.
"""
