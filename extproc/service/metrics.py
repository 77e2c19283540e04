"""Prometheus metrics of the routing service (served on service.metrics_listen at /metrics).

Per-request counters are incremented on pre-bound children (no label lookup on the hot
path); in-flight load and replica health are read from the router at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from extproc.service.gateway import Gateway

OUTCOMES = ("ok", "failed", "abandoned")


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter("llm_ring_decisions", "routing decisions", ["policy", "reason"], registry=r)
        self.decision_seconds = Histogram(
            "llm_ring_decision_seconds",
            "time to parse the body and decide (router.route included)",
            buckets=(25e-6, 50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 3.2e-3, 6.4e-3, 0.0128),
            registry=r,
        )
        self.completed = Counter(
            "llm_ring_requests_completed", "requests released from the ledger", ["outcome"], registry=r
        )
        self.errors = Counter("llm_ring_errors", "requests refused or failed", ["kind"], registry=r)
        self.predicted_cached = Counter(
            "llm_ring_predicted_cached_tokens",
            "cached prompt tokens the router predicted (requests with timings)",
            ["replica"],
            registry=r,
        )
        self.actual_cached = Counter(
            "llm_ring_actual_cached_tokens",
            "cached prompt tokens the replica reported (timings.cache_n)",
            ["replica"],
            registry=r,
        )
        self.actual_prompt = Counter(
            "llm_ring_actual_prompt_tokens",
            "prompt tokens the replica reported (cache_n + prompt_n)",
            ["replica"],
            registry=r,
        )
        self.prediction_error = Histogram(
            "llm_ring_cached_tokens_prediction_error",
            "actual cache_n minus predicted cached tokens, per request",
            buckets=(-4096, -1024, -256, -64, -16, -1, 0, 1, 16, 64, 256, 1024, 4096),
            registry=r,
        )
        self._decision_children: dict[tuple[str, str], Counter] = {}
        self._cache_children: dict[str, tuple[Counter, Counter, Counter]] = {}
        self.completed_children = {outcome: self.completed.labels(outcome) for outcome in OUTCOMES}

    def decision(self, policy: str, reason: str) -> None:
        child = self._decision_children.get((policy, reason))
        if child is None:
            child = self._decision_children[(policy, reason)] = self.decisions.labels(policy, reason)
        child.inc()

    def cache_tokens(self, replica: str, predicted: int, cached: int, prompt: int) -> None:
        """One request's predicted vs reported cached tokens (replica = where it was served)."""
        children = self._cache_children.get(replica)
        if children is None:
            children = self._cache_children[replica] = (
                self.predicted_cached.labels(replica),
                self.actual_cached.labels(replica),
                self.actual_prompt.labels(replica),
            )
        children[0].inc(predicted)
        children[1].inc(cached)
        children[2].inc(prompt)
        self.prediction_error.observe(cached - predicted)

    def watch(self, gateway: Gateway) -> None:
        """Expose the gateway's live state (in-flight load, health) at scrape time."""
        self.registry.register(_LiveState(lambda: gateway))


class _LiveState(Collector):
    def __init__(self, gateway: Callable[[], Gateway]) -> None:
        self._gateway = gateway

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gateway = self._gateway()
        ledger = gateway.router.ledger
        requests = GaugeMetricFamily(
            "llm_ring_in_flight_requests", "requests in flight per replica", labels=["replica"]
        )
        tokens = GaugeMetricFamily(
            "llm_ring_in_flight_tokens", "tokens charged in flight per replica", labels=["replica"]
        )
        healthy = GaugeMetricFamily(
            "llm_ring_replica_healthy",
            "1 unless a request failed there and /health has not answered since",
            labels=["replica"],
        )
        for name in gateway.router.replicas:
            requests.add_metric([name], ledger.requests(name))
            tokens.add_metric([name], ledger.tokens(name))
            healthy.add_metric([name], 0 if name in gateway.unhealthy else 1)
        yield requests
        yield tokens
        yield healthy
