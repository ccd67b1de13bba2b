"""The router's view of the indexer: Match with a deadline, a bound and a breaker.

Affinity is advice: routing never waits on it. Each Match gets a short
deadline; at most ``max_in_flight`` calls run at once (a call beyond that is
not made); after ``breaker_failures`` consecutive failures the circuit opens
and no call is made for ``breaker_cooldown_s``, after which one probe call
decides whether it closes again. Whatever goes wrong, :meth:`IndexerClient.match`
returns a :class:`MatchOutcome` with a non-OK status and no matches, and the
router routes on load alone. It never raises for indexer trouble.

The client sends block keys (computed by the router with
:mod:`kvmesh.blockkeys`), never token ids.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import grpc.aio
from opentelemetry import trace

from kvmesh.indexer.v1 import indexer_pb2 as pb
from kvmesh.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.tracing import inject_context, tracing_enabled
from router_client.config import IndexerClientSettings
from router_client.metrics import tracer

_SERVICE: str = pb.DESCRIPTOR.services_by_name["IndexerService"].full_name
#: Name of the Match client span (the server span has the same name).
_MATCH_METHOD = f"{_SERVICE}/Match"


class MatchStatus(enum.Enum):
    """How a Match attempt ended."""

    OK = "ok"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    UNAVAILABLE = "unavailable"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    CIRCUIT_OPEN = "circuit_open"
    #: ``max_in_flight`` calls were already running; this one was not made.
    BUSY = "busy"
    #: Any other status (e.g. INVALID_ARGUMENT): a bug, not an outage.
    ERROR = "error"


#: Status codes that count as the indexer being unavailable (they trip the breaker).
_FAILURE_CODES = {
    grpc.StatusCode.DEADLINE_EXCEEDED: MatchStatus.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE: MatchStatus.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: MatchStatus.RESOURCE_EXHAUSTED,
}


@dataclass(frozen=True, slots=True)
class WorkerMatch:
    """One worker's cached prefix of a prompt, per tier (see the proto's InstanceMatch)."""

    depth: int
    gpu_blocks: int = 0
    cpu_blocks: int = 0
    disk_blocks: int = 0


@dataclass(frozen=True, slots=True)
class MatchOutcome:
    """What a Match attempt produced: ``matches`` by worker name when OK."""

    status: MatchStatus
    matches: dict[str, WorkerMatch] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether the indexer answered."""
        return self.status is MatchStatus.OK


def instance_name(worker_id: str, dp_rank: int = 0) -> str:
    """The router's name of an indexer instance: the worker id, ``/dpN`` for rank N > 0."""
    return worker_id if dp_rank == 0 else f"{worker_id}/dp{dp_rank}"


def outcome_from_response(resp: pb.MatchResponse) -> MatchOutcome:
    """Convert a MatchResponse to an OK :class:`MatchOutcome`."""
    return MatchOutcome(
        MatchStatus.OK,
        {
            instance_name(m.instance.worker_id, m.instance.dp_rank): WorkerMatch(
                m.depth, m.gpu_blocks, m.cpu_blocks, m.disk_blocks
            )
            for m in resp.matches
        },
    )


class CircuitBreaker:
    """Consecutive-failure breaker: closed → open (cooldown) → half-open (one probe).

    Not thread-safe; used from one event loop.
    """

    def __init__(
        self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._threshold = failures
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._failures = 0
        self._open_until: float | None = None
        self._probing = False

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` or ``"half_open"``."""
        if self._open_until is None:
            return "closed"
        return "open" if self._clock() < self._open_until else "half_open"

    def allow(self) -> bool:
        """Whether a call may be made now (in half-open state: one probe at a time)."""
        if self._open_until is None:
            return True
        if self._clock() < self._open_until or self._probing:
            return False
        self._probing = True
        return True

    def success(self) -> None:
        """A call succeeded: close the circuit."""
        self._failures = 0
        self._open_until = None
        self._probing = False

    def failure(self) -> None:
        """A call failed: count it; open (again) at the threshold or after a failed probe."""
        self._failures += 1
        if self._probing or self._failures >= self._threshold:
            self._open_until = self._clock() + self._cooldown_s
        self._probing = False

    def release(self) -> None:
        """A call ended with neither verdict (e.g. a bad request): free the probe slot."""
        self._probing = False


class IndexerClient:
    """Match calls to one indexer, guarded as the module docstring says.

    Pass ``target`` (``host:port``) or a ready ``channel`` (closed by the
    caller then). Use from one asyncio event loop.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        channel: grpc.aio.Channel | None = None,
        settings: IndexerClientSettings | None = None,
        model: str = "",
        lora_name: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if (target is None) == (channel is None):
            raise ValueError("pass exactly one of target and channel")
        self.settings = settings or IndexerClientSettings()
        self._own_channel = channel is None
        self._channel = channel if channel is not None else grpc.aio.insecure_channel(str(target))
        self._stub = pb_grpc.IndexerServiceStub(self._channel)
        self._model = model
        self._lora = lora_name
        self.breaker = CircuitBreaker(
            self.settings.breaker_failures, self.settings.breaker_cooldown_s, clock
        )
        self.in_flight = 0
        self.calls: dict[MatchStatus, int] = dict.fromkeys(MatchStatus, 0)
        # Decided once: tracing off leaves the call path as it was.
        self._tracing = tracing_enabled()

    async def match(self, keys: Sequence[int]) -> MatchOutcome:
        """Match ``keys``; never raises for indexer trouble (see the module docstring)."""
        if not keys:
            return self._count(MatchOutcome(MatchStatus.OK))
        if self.in_flight >= self.settings.max_in_flight:
            return self._count(MatchOutcome(MatchStatus.BUSY))
        if not self.breaker.allow():
            return self._count(MatchOutcome(MatchStatus.CIRCUIT_OPEN))
        req = pb.MatchRequest(
            model=self._model, lora_name=self._lora, block_keys=keys, max_blocks=len(keys)
        )
        self.in_flight += 1
        try:
            if self._tracing:
                resp = await self._traced_match(req)
            else:
                resp = await self._stub.Match(req, timeout=self.settings.deadline_ms / 1000.0)
        except grpc.aio.AioRpcError as e:
            status = _FAILURE_CODES.get(e.code())
            if status is None:
                self.breaker.release()
                return self._count(MatchOutcome(MatchStatus.ERROR))
            self.breaker.failure()
            return self._count(MatchOutcome(status))
        finally:
            self.in_flight -= 1
        self.breaker.success()
        return self._count(outcome_from_response(resp))

    async def _traced_match(self, req: pb.MatchRequest) -> pb.MatchResponse:
        """Match under a CLIENT span whose context travels in the call's metadata
        (W3C ``traceparent``), so that the indexer's spans join the router's trace."""
        with tracer.start_as_current_span(
            _MATCH_METHOD,
            kind=trace.SpanKind.CLIENT,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": _SERVICE,
                "rpc.method": "Match",
                "kvmesh.blocks": len(req.block_keys),
            },
        ) as span:
            try:
                resp: pb.MatchResponse = await self._stub.Match(
                    req,
                    timeout=self.settings.deadline_ms / 1000.0,
                    metadata=inject_context(),
                )
            except grpc.aio.AioRpcError as e:
                span.set_attribute("rpc.grpc.status_code", e.code().name)
                raise
            span.set_attribute("rpc.grpc.status_code", "OK")
            span.set_attribute("kvmesh.matches", len(resp.matches))
            return resp

    def _count(self, outcome: MatchOutcome) -> MatchOutcome:
        self.calls[outcome.status] += 1
        return outcome

    async def close(self) -> None:
        """Close the channel if this client opened it."""
        if self._own_channel:
            await self._channel.close()
