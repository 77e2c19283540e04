"""The routing service's side of a migration (extproc/migration): which opening each
conversation has, so a slot's text can be traced back to its conversation, and the counts of
migrations reported through the Admin API, as Prometheus metrics.

A conversation's key is the hash of its x-conversation-id (or of its opening when there is
none); a llama.cpp slot holds only tokens. The opening's key (bodies.py) is what both sides can
compute: this service from the request body, the migrator from the slot's text.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.routing.continuation import of_model


class Migrations:
    def __init__(self, capacity: int, registry: CollectorRegistry) -> None:
        self.capacity = capacity  # conversations remembered, as placement memory (routing.memory_capacity)
        self._openings: dict[int, tuple[str, str]] = {}  # conversation key -> (its opening's key, its model)
        self.attempted = self.succeeded = self.failed = self.bytes = 0
        self.seconds = 0.0
        registry.register(_Collector(self))

    def opened(self, conversation_key: int, opening: str, model: str) -> None:
        openings = self._openings
        if openings.get(conversation_key) == (opening, model):
            return
        openings.pop(conversation_key, None)  # re-inserted as the newest
        openings[conversation_key] = (opening, model)
        if len(openings) > self.capacity:
            del openings[next(iter(openings))]

    def opening(self, conversation_key: int) -> str:
        """The key of the conversation's opening ("" when forgotten): what a slot's text gives."""
        return self._openings.get(conversation_key, ("", ""))[0]

    def blocks_key(self, conversation_key: int) -> str:
        """The conversation's key in BlockMemory ("" when forgotten)."""
        opening, model = self._openings.get(conversation_key, ("", ""))
        return of_model(model, opening) if opening else ""

    def reported(self, attempted: int, succeeded: int, failed: int, moved_bytes: int, seconds: float) -> None:
        self.attempted += attempted
        self.succeeded += succeeded
        self.failed += failed
        self.bytes += moved_bytes
        self.seconds += seconds


class _Collector(Collector):
    def __init__(self, migrations: Migrations) -> None:
        self.migrations = migrations

    def collect(self) -> Iterator[Metric]:
        m = self.migrations
        outcomes = CounterMetricFamily("llm_ring_migrations", "conversation caches a migration tried to move",
                                       labels=["outcome"])
        for outcome, count in (("attempted", m.attempted), ("succeeded", m.succeeded), ("failed", m.failed)):
            outcomes.add_metric([outcome], count)
        yield outcomes
        moved = CounterMetricFamily("llm_ring_migrated_bytes", "bytes of slot files migrations wrote and read")
        moved.add_metric([], m.bytes)
        yield moved
        took = CounterMetricFamily("llm_ring_migration_seconds", "time migrations took (drain excluded)")
        took.add_metric([], m.seconds)
        yield took
