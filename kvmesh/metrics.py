"""The Prometheus registry every kvmesh component exposes on its metrics endpoint.

A :class:`ComponentRegistry` is a ``CollectorRegistry`` that follows the
fleet's exposition conventions, whoever scrapes it:

- the standard process and runtime families: ``process_*`` (CPU seconds,
  resident and virtual memory, open and maximum file descriptors, start
  time; on Linux, where ``/proc`` has them), ``python_info`` and
  ``python_gc_*``;
- ``kvmesh_build_info{version}``, always 1, naming the kvmesh release that
  runs (join on it to tell versions apart during a rollout);
- no ``<name>_created`` series: prometheus_client exports one per counter,
  histogram and summary child, a timestamp that doubles the series count of
  every counter and that Prometheus (scraping the text format) stores as a
  gauge nobody asked for. The registry leaves them out at collection time,
  for this registry alone: prometheus_client's own switch
  (``disable_created_metrics()``, ``PROMETHEUS_DISABLE_CREATED_SERIES``) is
  process-wide and would change the metrics of an application that embeds a
  kvmesh component (a router running :class:`tee.logic.Tee`). Only a scrape
  that asks for a ``_created`` series by name (``/metrics?name[]=...``) still
  gets it.

The indexer, the tee, the cache simulator and the xfer sidecar build their
metrics on one of these (``Metrics``, ``TeeMetrics``, ``CacheSimServer``,
``XferMetrics``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.gc_collector import GCCollector
from prometheus_client.metrics_core import Metric
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from kvmesh import __version__

#: The build information gauge, named as Prometheus's own (``prometheus_build_info``).
BUILD_INFO = "kvmesh_build_info"

#: Metric types whose children carry a ``_created`` sample in prometheus_client.
_WITH_CREATED = frozenset({"counter", "histogram", "summary"})


class ComponentRegistry(CollectorRegistry):
    """A component's registry: process, runtime and build families in, ``_created`` out.

    Thread-safe as ``CollectorRegistry`` is. Register the component's own
    metrics on it as on any registry; serve it with ``start_http_server`` or
    ``generate_latest``.
    """

    def __init__(self) -> None:
        super().__init__()
        ProcessCollector(registry=self)
        PlatformCollector(registry=self)
        GCCollector(registry=self)
        Gauge(
            BUILD_INFO, "kvmesh release of this process (always 1).", ["version"], registry=self
        ).labels(__version__).set(1)

    def collect(self) -> Iterator[Metric]:
        """Every family of the registry, without ``<name>_created`` samples."""
        for metric in super().collect():
            if metric.type not in _WITH_CREATED:
                yield metric
                continue
            created = metric.name + "_created"
            kept = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            kept.samples = [s for s in metric.samples if s.name != created]
            yield kept


def observe_many(hist: Histogram, amount: float, n: int) -> None:
    """``n`` observations of ``amount`` in ``hist`` (an unlabelled histogram or a
    child): what ``n`` calls of ``hist.observe(amount)`` record, in one step.

    A call that checks and queues 64 chunks observes each chunk's share of its
    time: 64 ``observe`` calls cost about 110 µs here, a third of the call's own
    work. This adds ``n`` to the one bucket and ``amount * n`` to the sum through
    the histogram's values, as ``observe`` does once; a prometheus_client whose
    histogram lacks those attributes gets the ``n`` calls."""
    if n <= 0:
        return
    bounds = getattr(hist, "_upper_bounds", None)
    buckets = getattr(hist, "_buckets", None)
    total = getattr(hist, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for _ in range(n):
            hist.observe(amount)
        return
    hist._raise_if_not_observable()  # type: ignore[no-untyped-call]
    total.inc(amount * n)
    for i, bound in enumerate(bounds):
        if amount <= bound:
            buckets[i].inc(n)
            break
