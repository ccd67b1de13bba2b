"""The indexer's errors: the shared hierarchy of :mod:`kvmesh.errors`."""

from kvmesh.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvmeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)

__all__ = [
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidArgument",
    "KvmeshError",
    "NotFound",
    "ResourceExhausted",
    "Unavailable",
]
