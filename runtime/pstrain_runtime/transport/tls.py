"""TLS on both parameter-server channels (opt-in: `spec.security.tls`).

A replica finds its certificate material in the directory PSTRAIN_TLS_DIR names: a
kubernetes.io/tls Secret (e.g. one cert-manager issues) with `tls.crt`, `tls.key` and
`ca.crt`. Servers present tls.crt; every client trusts only ca.crt and checks the
server's name (the host of its address: `<pod>.<job>.<namespace>.svc` in Kubernetes,
so the certificate should name `*.<job>.<namespace>.svc`). gRPC uses grpcio's SSL
credentials; the data plane wraps its sockets with `ssl` (which has no sendmsg, so
`dataplane.Link` sends buffer by buffer over TLS).

TLS protects against whoever can watch or alter the job's traffic; authentication
(`auth`) still decides who may call what.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from pstrain_api import security

HANDSHAKE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class TlsFiles:
    """The certificate files of one replica."""

    directory: Path

    @property
    def cert(self) -> Path:
        return self.directory / "tls.crt"

    @property
    def key(self) -> Path:
        return self.directory / "tls.key"

    @property
    def ca(self) -> Path:
        return self.directory / "ca.crt"

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        return context

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context

    def grpc_server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])

    def grpc_channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca.read_bytes())


@dataclass(frozen=True)
class TrustedCa:
    """Only a CA to trust, in memory (what the operator's status probe has: the ca.crt
    of the job's TLS Secret)."""

    pem: bytes

    def grpc_channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.pem)


def load_tls(environ: Mapping[str, str]) -> TlsFiles | None:
    """The TLS files in PSTRAIN_TLS_DIR, or None when it is unset (TLS off). Raises
    ValueError naming a missing file."""
    raw = environ.get(security.ENV_TLS_DIR)
    if not raw:
        return None
    files = TlsFiles(Path(raw))
    for name in security.TLS_FILES:
        if not (files.directory / name).is_file():
            raise ValueError(f"{security.ENV_TLS_DIR} is {raw!r}; it holds no {name} (a "
                             f"kubernetes.io/tls Secret with {', '.join(security.TLS_FILES)})")
    return files


def accept(context: ssl.SSLContext, sock: socket.socket,
           timeout_s: float = HANDSHAKE_TIMEOUT_S) -> ssl.SSLSocket:
    """The server side of TLS on an accepted connection, bounded in time. Raises
    OSError (ssl.SSLError included) when it fails."""
    sock.settimeout(timeout_s)
    wrapped = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
    wrapped.do_handshake()
    return wrapped


def connect(context: ssl.SSLContext, sock: socket.socket, host: str,
            timeout_s: float = HANDSHAKE_TIMEOUT_S) -> ssl.SSLSocket:
    """The client side of TLS on a fresh connection to `host` (its name is checked)."""
    sock.settimeout(timeout_s)
    wrapped = context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
    wrapped.do_handshake()
    return wrapped
