"""Errors of the tee and the cache simulator, each naming the gRPC status it maps to.

Logic modules never import grpc: ``code`` is the name of a ``grpc.StatusCode``
member (tee/grpc_common.py maps it once) and ``http_status`` what the HTTP
transport answers.
"""

from __future__ import annotations


class TeeError(Exception):
    """Base error. ``code`` names the gRPC status; ``field`` the offending input."""

    code = "INTERNAL"
    http_status = 500

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class InvalidEvent(TeeError):
    """A malformed event: it can never be accepted as sent."""

    code = "INVALID_ARGUMENT"
    http_status = 400


class TooLarge(InvalidEvent):
    """An event beyond a size cap (too many input_ids or events)."""

    http_status = 413


class UnknownModel(TeeError):
    """A report was asked for a model the simulator has not seen."""

    code = "NOT_FOUND"
    http_status = 404
