"""The routed-request event and its wire forms.

HTTP wire (SGLang's cache-sim wire): ``POST /ingest_ids`` for each routed
prompt and ``POST /extend_ids`` with prompt + output after a response, with the
JSON body ``{model, input_ids, request_id, prompt_len?, choice_index?,
choice_count?, output_tokens?}``; an absent optional field is omitted, never
``null``. The worker a request was routed to travels in the
``x-kvmesh-worker`` header and the request id also in ``x-request-id``, so the
body stays exactly SGLang's; with tracing on, the W3C ``traceparent`` (and
``tracestate``) headers carry the request's trace. gRPC wire:
``kvmesh.tee.v1.RoutedEvent``, the trace context in the call's metadata.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from tee.errors import InvalidEvent, TooLarge

#: Header carrying the worker a request was routed to.
WORKER_HEADER = "x-kvmesh-worker"
#: Correlation header carrying the request id.
REQUEST_ID_HEADER = "x-request-id"

#: Default cap on input_ids per event. Long-context prompts reach 1M tokens;
#: beyond that an event is more likely a bug than a request, and one event must
#: not be able to make a sink or the simulator allocate without bound.
DEFAULT_MAX_INPUT_IDS = 1 << 20

_TOKEN_LIMIT = 1 << 32
_MAX_NAME_BYTES = 256
_OPTIONAL_INTS = ("prompt_len", "choice_index", "choice_count", "output_tokens")


class EventKind(StrEnum):
    """What happened to a request; the value is the HTTP path's last segment."""

    INGEST = "ingest_ids"
    EXTEND = "extend_ids"


@dataclass(frozen=True, slots=True)
class RoutedEvent:
    """One routed-request event.

    ``input_ids`` is the prompt for :attr:`EventKind.INGEST` and prompt +
    output for :attr:`EventKind.EXTEND`. ``worker`` is empty when the router
    did not say where the request went. Constructing one does not validate it
    (the serving path must stay cheap); :func:`validate` does, and the tee
    checks only the size cap.
    """

    kind: EventKind
    model: str
    input_ids: Sequence[int]
    request_id: str = ""
    prompt_len: int | None = None
    choice_index: int | None = None
    choice_count: int | None = None
    output_tokens: int | None = None
    worker: str = ""
    #: Trace context of the request (``traceparent``, ``tracestate`` pairs),
    #: captured by :meth:`tee.logic.Tee.offer` when tracing is on; sinks send
    #: it as HTTP headers or gRPC metadata. Not part of the JSON body.
    trace_context: tuple[tuple[str, str], ...] = ()

    def body(self) -> dict[str, Any]:
        """The JSON body of the HTTP wire (absent optional fields omitted)."""
        out: dict[str, Any] = {
            "model": self.model,
            "input_ids": list(self.input_ids),
            "request_id": self.request_id,
        }
        for name in _OPTIONAL_INTS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def body_bytes(self) -> bytes:
        """:meth:`body` encoded as compact UTF-8 JSON."""
        return json.dumps(self.body(), separators=(",", ":")).encode()

    def headers(self) -> dict[str, str]:
        """Correlation headers of the HTTP wire."""
        out = {"content-type": "application/json"}
        if self.request_id:
            out[REQUEST_ID_HEADER] = self.request_id
        if self.worker:
            out[WORKER_HEADER] = self.worker
        if self.trace_context:
            out.update(self.trace_context)
        return out


def ingest(
    model: str,
    prompt_ids: Sequence[int],
    request_id: str = "",
    *,
    worker: str = "",
    choice_index: int | None = None,
    choice_count: int | None = None,
) -> RoutedEvent:
    """The event of a routed prompt (``/ingest_ids``)."""
    return RoutedEvent(
        EventKind.INGEST,
        model,
        prompt_ids,
        request_id,
        choice_index=choice_index,
        choice_count=choice_count,
        worker=worker,
    )


def extend(
    model: str,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    request_id: str = "",
    *,
    worker: str = "",
    choice_index: int | None = None,
    choice_count: int | None = None,
) -> RoutedEvent:
    """The event of a finished response (``/extend_ids``): prompt + output."""
    return RoutedEvent(
        EventKind.EXTEND,
        model,
        [*prompt_ids, *output_ids],
        request_id,
        prompt_len=len(prompt_ids),
        choice_index=choice_index,
        choice_count=choice_count,
        output_tokens=len(output_ids),
        worker=worker,
    )


def _check_name(value: object, field: str, *, required: bool) -> str:
    if not isinstance(value, str):
        raise InvalidEvent(f"must be a string, got {type(value).__name__}", field=field)
    if required and not value:
        raise InvalidEvent("must not be empty", field=field)
    if len(value.encode()) > _MAX_NAME_BYTES:
        raise InvalidEvent(f"longer than {_MAX_NAME_BYTES} bytes", field=field)
    return value


def _shown(value: object, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error names what it refused,
    it does not echo a client's 4,000-digit number or name back."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**limit else "a huge int"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def validate(event: RoutedEvent, max_input_ids: int = DEFAULT_MAX_INPUT_IDS) -> RoutedEvent:
    """Check every field of ``event``; return it or raise :class:`InvalidEvent` naming the field."""
    if not isinstance(event.kind, EventKind):
        raise InvalidEvent("must be INGEST or EXTEND", field="kind")
    _check_name(event.model, "model", required=True)
    _check_name(event.request_id, "request_id", required=False)
    _check_name(event.worker, "worker", required=False)
    ids = event.input_ids
    if len(ids) > max_input_ids:
        raise TooLarge(f"{len(ids)} ids exceed the cap of {max_input_ids}", field="input_ids")
    for i, t in enumerate(ids):
        if type(t) is not int or not 0 <= t < _TOKEN_LIMIT:
            raise InvalidEvent(
                f"input_ids[{i}] = {_shown(t)} is not in [0, 2^32)", field="input_ids"
            )
    for name in _OPTIONAL_INTS:
        value = getattr(event, name)
        if value is not None and (type(value) is not int or not 0 <= value < _TOKEN_LIMIT):
            raise InvalidEvent(f"must be an integer in [0, 2^32), got {_shown(value)}", field=name)
    if event.prompt_len is not None and event.prompt_len > len(ids):
        raise InvalidEvent(
            f"{event.prompt_len} exceeds the {len(ids)} input_ids", field="prompt_len"
        )
    return event


def from_body(
    kind: EventKind,
    body: object,
    *,
    worker: str = "",
    request_id_header: str = "",
    max_input_ids: int = DEFAULT_MAX_INPUT_IDS,
) -> RoutedEvent:
    """Parse and validate a decoded HTTP JSON body; raise :class:`InvalidEvent` naming the field."""
    if not isinstance(body, Mapping):
        raise InvalidEvent("body must be a JSON object", field="body")
    unknown = sorted(set(body) - {"model", "input_ids", "request_id", *_OPTIONAL_INTS})
    if unknown:
        name = unknown[0] if len(unknown[0]) <= 64 else unknown[0][:63] + "…"
        raise InvalidEvent(f"unknown field {name!r}", field=name)
    if "model" not in body:
        raise InvalidEvent("missing", field="model")
    ids = body.get("input_ids")
    if not isinstance(ids, list):
        raise InvalidEvent("must be a list of token ids", field="input_ids")
    if len(ids) > max_input_ids:
        raise TooLarge(f"{len(ids)} ids exceed the cap of {max_input_ids}", field="input_ids")
    optional: dict[str, Any] = {}
    for name in _OPTIONAL_INTS:
        value = body.get(name)
        if value is not None:  # null is taken as absent, as SGLang senders may write it
            optional[name] = value
    event = RoutedEvent(
        kind,
        body["model"],
        ids,
        body.get("request_id") or request_id_header,
        worker=worker,
        **optional,
    )
    return validate(event, max_input_ids)
