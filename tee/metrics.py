"""Prometheus metrics of the tee, in one registry, and the lane counter snapshot they read.

The lane counters are plain ints (the serving path pays nothing for
metrics); a collector reads them, as :class:`LaneStats`, at scrape time.
Only the send latency histogram is observed as sends complete. The servers
(tee and cache simulator) add their refusal counters with
:func:`refusal_counter`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmesh.metrics import ComponentRegistry

#: Send latency buckets: a healthy local sink answers in 1-20 ms; the top
#: buckets catch sends that approach the 2 s default timeout.
SEND_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)


@dataclass(frozen=True, slots=True)
class LaneStats:
    """A snapshot of one lane's counters, as :class:`tee.logic.SinkLane` keeps them.

    Every event offered is in exactly one of the other counters at every
    instant (:meth:`balanced`; the lane's counting is described in tee/logic.py).
    """

    sink: str
    offered: int
    sent: int
    dropped_full: int
    dropped_closed: int
    dropped_invalid: int
    failed_http: int
    failed_error: int
    failed_timeout: int
    queued: int
    in_flight: int

    @property
    def dropped(self) -> int:
        """All drops."""
        return self.dropped_full + self.dropped_closed + self.dropped_invalid

    @property
    def failed(self) -> int:
        """All failed sends."""
        return self.failed_http + self.failed_error + self.failed_timeout

    def balanced(self) -> bool:
        """Whether the counters add up (they always should)."""
        return self.offered == (
            self.sent + self.dropped + self.failed + self.queued + self.in_flight
        )

    def as_dict(self) -> dict[str, int | str]:
        """A JSON-friendly view."""
        return asdict(self)


class _LaneCollector(Collector):
    def __init__(self) -> None:
        self.sources: list[Callable[[], Sequence[LaneStats]]] = []

    def collect(self) -> Iterator[Any]:
        offered = CounterMetricFamily("kvmesh_tee_offered", "Events offered.", labels=["sink"])
        sent = CounterMetricFamily("kvmesh_tee_sent", "Events delivered.", labels=["sink"])
        dropped = CounterMetricFamily(
            "kvmesh_tee_dropped", "Events dropped at offer or close.", labels=["sink", "reason"]
        )
        failed = CounterMetricFamily(
            "kvmesh_tee_failed", "Sends that failed.", labels=["sink", "reason"]
        )
        queued = GaugeMetricFamily("kvmesh_tee_queued", "Events in the queue.", labels=["sink"])
        in_flight = GaugeMetricFamily("kvmesh_tee_in_flight", "Sends in flight.", labels=["sink"])
        for source in self.sources:
            for s in source():
                offered.add_metric([s.sink], s.offered)
                sent.add_metric([s.sink], s.sent)
                dropped.add_metric([s.sink, "full"], s.dropped_full)
                dropped.add_metric([s.sink, "closed"], s.dropped_closed)
                dropped.add_metric([s.sink, "invalid"], s.dropped_invalid)
                failed.add_metric([s.sink, "http"], s.failed_http)
                failed.add_metric([s.sink, "error"], s.failed_error)
                failed.add_metric([s.sink, "timeout"], s.failed_timeout)
                queued.add_metric([s.sink], s.queued)
                in_flight.add_metric([s.sink], s.in_flight)
        yield from (offered, sent, dropped, failed, queued, in_flight)


class TeeMetrics:
    """The tee's metrics: lane counters (collected at scrape) and the send latency histogram."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else ComponentRegistry()
        self._lanes = _LaneCollector()
        self.registry.register(self._lanes)
        self.send_seconds = Histogram(
            "kvmesh_tee_send_seconds",
            "Latency of successful sends.",
            ["sink"],
            buckets=SEND_BUCKETS,
            registry=self.registry,
        )

    def watch(self, source: Callable[[], Sequence[LaneStats]]) -> None:
        """Report the lanes ``source`` returns at every scrape."""
        self._lanes.sources.append(source)


def refusal_counter(registry: CollectorRegistry, service: str) -> Counter:
    """``kvmesh_<service>_refusals_total{method,code}`` in ``registry``.

    Feed it from ``Guard.on_refusal``: calls (gRPC methods, HTTP paths)
    refused before reaching the service: UNAUTHENTICATED and
    PERMISSION_DENIED (identity, role), RESOURCE_EXHAUSTED (per-client
    limits), INVALID_ARGUMENT (undecodable request).
    """
    return Counter(
        f"kvmesh_{service}_refusals_total",
        "Calls refused before reaching the service: UNAUTHENTICATED and PERMISSION_DENIED "
        "(identity, role), RESOURCE_EXHAUSTED (per-client limits), INVALID_ARGUMENT "
        "(undecodable request), by method (gRPC method or HTTP path).",
        ["method", "code"],
        registry=registry,
    )
