"""kvmesh errors, each carrying the gRPC status it maps to (indexer, tee, xfer).

The logic never imports grpc: ``code`` is the name of a ``grpc.StatusCode``
member, and every server maps it once, in its call scope
(:func:`kvmesh.grpcsvc.status_code`). An exception that is not a
:class:`KvmeshError` reaches clients as INTERNAL, never UNKNOWN. The offending
field of an error travels in the trailing metadata entry
:data:`ERROR_FIELD_METADATA`, which clients read back, and, for every
language's gRPC library, as a ``google.rpc.Status`` in
``grpc-status-details-bin``: a ``google.rpc.BadRequest`` field violation for
INVALID_ARGUMENT, a ``google.rpc.RetryInfo`` when the error knows how long to
wait (``retry_after_s``).
"""

from __future__ import annotations

#: Trailing metadata key carrying the offending field of an error (``KvmeshError.field``).
ERROR_FIELD_METADATA = "kvmesh-error-field"


class KvmeshError(Exception):
    """Base error. ``code`` names the gRPC status; ``field`` the offending input.

    ``retry_after_s``: when set, the caller may retry the same call after that
    many seconds (a rate limit knows when its next token arrives); None when
    the error says nothing about retrying.
    """

    code = "INTERNAL"

    def __init__(
        self, message: str, *, field: str = "", retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class InvalidArgument(KvmeshError):
    """Bad input: the request can never succeed as sent."""

    code = "INVALID_ARGUMENT"


class NotFound(KvmeshError):
    """The named instance (or other entity) does not exist."""

    code = "NOT_FOUND"


class FailedPrecondition(KvmeshError):
    """Valid input the current state refuses, e.g. events of an unregistered instance."""

    code = "FAILED_PRECONDITION"


class Unavailable(KvmeshError):
    """The backend (Redis) cannot be reached; retry later."""

    code = "UNAVAILABLE"


class ResourceExhausted(KvmeshError):
    """Overload or a size cap hit."""

    code = "RESOURCE_EXHAUSTED"


class DeadlineExceeded(KvmeshError):
    """The work did not finish within its deadline."""

    code = "DEADLINE_EXCEEDED"


class Unauthenticated(KvmeshError):
    """The caller presented no identity, or one that does not verify."""

    code = "UNAUTHENTICATED"


class PermissionDenied(KvmeshError):
    """The caller's identity may not do this (role or instance ownership)."""

    code = "PERMISSION_DENIED"
