"""Errors of the tee and the cache simulator: :class:`~kvmesh.errors.KvmeshError` subclasses.

Logic modules never import grpc: ``code`` is the name of a ``grpc.StatusCode``
member (the call scope of kvmesh/grpcsvc.py maps it, as for every kvmesh
error) and ``http_status`` what the HTTP transport answers.
"""

from __future__ import annotations

from kvmesh.errors import InvalidArgument, KvmeshError, NotFound


class TeeError(KvmeshError):
    """Base error of the tee. ``code`` names the gRPC status; ``field`` the offending input."""

    http_status = 500


class InvalidEvent(TeeError, InvalidArgument):
    """A malformed event: it can never be accepted as sent."""

    code = "INVALID_ARGUMENT"
    http_status = 400


class TooLarge(InvalidEvent):
    """An event beyond a size cap (too many input_ids or events)."""

    http_status = 413


class UnknownModel(TeeError, NotFound):
    """A report was asked for a model the simulator has not seen."""

    code = "NOT_FOUND"
    http_status = 404
