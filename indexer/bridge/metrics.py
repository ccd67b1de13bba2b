"""The bridge's Prometheus families, read from its counters at each scrape.

Counters ``kvmesh_bridge_<name>_total``, summed over the bridge's engine
endpoints: the stream logic's (:class:`~indexer.kvevents.subscriber.SubscriberCounters`:
batches applied, duplicate, rejected, gaps, replays, batches replayed,
unrecoverable gaps, publisher restarts, registrations, rebuilds...), the
buffers' (``batches_buffered``, ``batches_dropped``, ``bytes_dropped``) and the
link's (:class:`~indexer.bridge.link.LinkCounters`: batches sent, resent and
published, events published, stream failures, ack timeouts...; a counter by
reason or status code carries a ``reason`` label). Gauges:
``kvmesh_bridge_buffer_batches`` and ``kvmesh_bridge_buffer_bytes`` (held now),
``kvmesh_bridge_buffer_high_water_batches``, ``kvmesh_bridge_indexer_up`` (the
last call or ack reached an indexer), ``kvmesh_bridge_engines_connected``
(endpoints whose engine socket is connected).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: One scrape's values: counters (an int, or a count per reason) and gauges.
Snapshot = tuple[Mapping[str, int | Mapping[str, int]], Mapping[str, float]]


class BridgeCollector(Collector):
    """Families of :data:`Snapshot` values from ``read`` (called at each scrape)."""

    def __init__(self, read: Callable[[], Snapshot]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        """The bridge's counters and gauges as they are now."""
        counters, gauges = self._read()
        for name, value in counters.items():
            if isinstance(value, Mapping):
                fam = CounterMetricFamily(
                    f"kvmesh_bridge_{name}", f"Bridge counter {name}, by reason.", labels=["reason"]
                )
                for reason, n in sorted(value.items()):
                    fam.add_metric([reason], n)
                yield fam
                continue
            yield CounterMetricFamily(
                f"kvmesh_bridge_{name}", f"Bridge counter {name}.", value=value
            )
        for name, g in gauges.items():
            yield GaugeMetricFamily(f"kvmesh_bridge_{name}", f"Bridge gauge {name}.", value=g)
