"""gRPC plumbing shared by the tee and cache simulator servers: messages in, statuses out.

:func:`event_from_pb` validates a ``RoutedEvent`` message (raising
:class:`~tee.errors.InvalidEvent` naming the field); :func:`guard` runs a
handler body and maps a :class:`~tee.errors.TeeError` or
:class:`~kvmesh.errors.KvmeshError` (a per-client limit, say) to its status
(the field in the message and in the ``kvmesh-error-field`` trailing
metadata) and any other exception to INTERNAL, so no call ends UNKNOWN.
Identity, roles and per-client limits are checked before a handler runs, by
the :class:`kvmesh.grpcsvc.Guard` each server registers its services behind.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import grpc.aio

from kvmesh.auth import current_client
from kvmesh.errors import KvmeshError, ResourceExhausted
from kvmesh.grpcsvc import Guard
from kvmesh.runtime import status_code
from kvmesh.tee.v1 import tee_pb2 as pb
from tee.errors import InvalidEvent, TeeError, TooLarge
from tee.events import EventKind, RoutedEvent, validate

log = logging.getLogger(__name__)

#: Trailing metadata key carrying the offending field of an error.
ERROR_FIELD_METADATA = "kvmesh-error-field"

_KINDS = {pb.EVENT_KIND_INGEST: EventKind.INGEST, pb.EVENT_KIND_EXTEND: EventKind.EXTEND}
_OPTIONAL = ("prompt_len", "choice_index", "choice_count", "output_tokens")

_T = TypeVar("_T")


def event_from_pb(
    msg: pb.RoutedEvent, max_input_ids: int, prefix: str = "events[0]"
) -> RoutedEvent:
    """Convert and validate one event; errors name ``{prefix}.{field}``."""
    kind = _KINDS.get(msg.kind)
    if kind is None:
        raise InvalidEvent(
            f"must be EVENT_KIND_INGEST or EVENT_KIND_EXTEND, got {msg.kind}",
            field=f"{prefix}.kind",
        )
    n = len(msg.input_ids)
    if n > max_input_ids:
        raise TooLarge(f"{n} ids exceed the cap of {max_input_ids}", field=f"{prefix}.input_ids")
    optional = {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
    event = RoutedEvent(
        kind, msg.model, list(msg.input_ids), msg.request_id, worker=msg.worker, **optional
    )
    try:
        return validate(event, max_input_ids)
    except InvalidEvent as e:
        e.field = f"{prefix}.{e.field}"
        raise


def events_from_pb(
    msgs: Any, max_input_ids: int, max_events: int, field: str = "events"
) -> list[RoutedEvent]:
    """Convert a repeated RoutedEvent field; the whole batch is refused on the first error."""
    if len(msgs) > max_events:
        raise TooLarge(f"{len(msgs)} events exceed the cap of {max_events}", field=field)
    return [event_from_pb(m, max_input_ids, f"{field}[{i}]") for i, m in enumerate(msgs)]


async def guard(
    context: grpc.aio.ServicerContext[Any, Any], method: str, body: Callable[[], Awaitable[_T]]
) -> _T:
    """Run ``body``; end the call with the mapped status if it raises (never UNKNOWN)."""
    try:
        return await body()
    except (TeeError, KvmeshError) as e:
        if e.field:
            context.set_trailing_metadata(((ERROR_FIELD_METADATA, e.field),))
        await context.abort(status_code(e.code), str(e))
    except Exception as e:
        if type(e).__name__ == "AbortError":  # grpc.aio's own abort: let it through
            raise
        log.exception("internal error in %s", method)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")
    raise AssertionError("unreachable")  # pragma: no cover - abort raises


def take_stream_message(guard_: Guard, method: str) -> bool:
    """Count one streamed message against the caller's publish rate; False: over it.

    The refusal is counted (and reported to ``guard_.on_refusal``) by the guard.
    """
    client = current_client()
    if client is None:
        return True
    try:
        guard_.take(client, "publish", method)
    except ResourceExhausted:
        return False
    return True
