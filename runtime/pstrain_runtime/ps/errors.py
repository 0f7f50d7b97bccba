"""`PSError`: a request the parameter server refuses. Every part of the server side
raises it; the transports turn it into a status (gRPC) or an error frame (data plane)."""

from __future__ import annotations


class PSError(Exception):
    """A request the parameter server refuses. `code` names a grpc.StatusCode."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> PSError:
    return PSError("INVALID_ARGUMENT", message)
