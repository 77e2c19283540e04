"""Flow control's Prometheus metrics (served with the others on service.metrics_listen).

As in metrics.py, the hot path only adds to plain counters; one collector reads them, and the
queue's live depths, at scrape time. A tenant is a header's value: only the TENANT_SERIES
tenants with the most requests waiting get a series of their own, the rest are summed as
"other", so a client inventing tenants cannot grow the scrape.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.routing.fairness import FairnessWindow
from extproc.routing.flows import Flow
from extproc.service.metrics import Histogram

TENANT_SERIES = 20
OTHER = "other"
WAIT_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
JAIN_WINDOW_S = 60.0
# how a request left flow control: routed at once, from the queue (and why then), or not at all
OUTCOMES = ("at_once", "local", "new", "fair", "expired", "cancelled", "queue_full", "no_replica")

Depths = Callable[[], Iterable[tuple[Flow, int]]]


class FlowMetrics:
    def __init__(self, registry: CollectorRegistry, depths: Depths, clock: Callable[[], float]) -> None:
        self.depths = depths
        self.clock = clock
        self.outcomes: Counter[tuple[int, str]] = Counter()  # (band, outcome)
        self.waits: dict[str, Histogram] = {}  # band -> seconds waited by the requests that left the queue
        self.fairness = FairnessWindow(JAIN_WINDOW_S)
        registry.register(_Collector(self))

    def outcome(self, flow: Flow, outcome: str) -> None:
        self.outcomes[flow.priority, outcome] += 1

    def left_queue(self, flow: Flow, seconds: float) -> None:
        band = str(flow.priority)
        histogram = self.waits.get(band)
        if histogram is None:
            histogram = self.waits[band] = Histogram(WAIT_SECONDS)
        histogram.observe(seconds)


class _Collector(Collector):
    def __init__(self, metrics: FlowMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        outcomes = CounterMetricFamily("llm_ring_flow_requests", "requests through flow control, by band and how "
                                       "they left: " + ", ".join(OUTCOMES), labels=["band", "outcome"])
        for (priority, outcome), count in dict(m.outcomes).items():
            outcomes.add_metric([str(priority), outcome], count)
        yield outcomes
        waiting = GaugeMetricFamily("llm_ring_flow_waiting", f"requests waiting in the router, by band and tenant "
                                    f"(the {TENANT_SERIES} with the most waiting; the rest as {OTHER!r})",
                                    labels=["band", "tenant"])
        for (band, tenant), count in _top_tenants(m.depths()).items():
            waiting.add_metric([band, tenant], count)
        yield waiting
        waits = HistogramMetricFamily("llm_ring_flow_wait_seconds", "time requests waited in the router before "
                                      "they left for a replica", labels=["band"])
        for band, histogram in list(m.waits.items()):
            cumulative, buckets = 0, []
            for bound, count in zip([*map(str, histogram.bounds), "+Inf"], list(histogram.counts), strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            waits.add_metric([band], buckets, histogram.sum)
        yield waits
        jain = GaugeMetricFamily("llm_ring_flow_jain_index", f"Jain's index of the work served to the tenants that "
                                 f"waited in the last {JAIN_WINDOW_S:g} s (1: equal shares)")
        jain.add_metric([], m.fairness.jain(m.clock()))
        yield jain


def _top_tenants(depths: Iterable[tuple[Flow, int]]) -> dict[tuple[str, str], int]:
    ranked = sorted(depths, key=lambda item: -item[1])
    shown: Counter[tuple[str, str]] = Counter()
    for index, (flow, count) in enumerate(ranked):
        shown[str(flow.priority), flow.tenant if index < TENANT_SERIES else OTHER] += count
    return dict(shown)
