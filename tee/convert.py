"""Conversion of ``kvmesh.tee.v1`` messages to the tee's events, for the tee and simulator servers.

:func:`event_from_pb` converts and validates a ``RoutedEvent`` message,
raising :class:`~tee.errors.InvalidEvent` (or :class:`~tee.errors.TooLarge`
beyond a cap) naming the field with the proto's path, e.g.
``events[2].input_ids``. No grpc here: statuses, identity and per-client
limits are the call scope's (kvmesh/grpcsvc.py), which each server registers
its services in.
"""

from __future__ import annotations

from typing import Any

from kvmesh.api.tee.v1 import tee_pb2 as pb
from tee.errors import InvalidEvent, TooLarge
from tee.events import EventKind, RoutedEvent, validate

_KINDS = {pb.EVENT_KIND_INGEST: EventKind.INGEST, pb.EVENT_KIND_EXTEND: EventKind.EXTEND}
_OPTIONAL = ("prompt_len", "choice_index", "choice_count", "output_tokens")


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
