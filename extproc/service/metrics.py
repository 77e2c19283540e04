"""Prometheus metrics of the routing service (served on service.metrics_listen at /metrics).

The hot path only adds to plain dicts and lists (the service is one event loop: no locks,
no label lookups; prometheus_client's own Counter and Histogram cost ~1-3 µs a call, and a
request made eleven of them). One collector turns them into metric families at scrape time,
together with the live state read from the router (in-flight load, replica health).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.routing.speeds import Speed

# not_applied: Envoy never used the pick (fail-open after ext_proc's timeout) and served round robin
OUTCOMES = ("ok", "failed_over", "failed", "abandoned", "not_applied")
# non_utf8_repaired: a message from Envoy carried client bytes that are not UTF-8 (repaired,
# see wire.py); undecodable: a message that was no protobuf at all (dropped); migration_unauthenticated:
# a call to the migration port without its token (bearer.py); refused_path: a path or method the
# gateway does not serve (surface.py); unknown_model: a generation naming a model no replica serves
ERRORS = (
    "bad_request", "no_replica", "replica_failed", "replica_timed_out", "access_log_lost", "non_utf8_repaired",
    "undecodable", "shed", "migration_unauthenticated", "refused_path", "unknown_model",
)
# requests the gateway answers itself (surface.py): the fleet's models, one model, health, CORS preflights
LOCAL_ANSWERS = ("models", "model", "health", "preflight")
STREAMS = ("route", "observe", "access_log", "picker")
# the shared store (store.py): a read before a decision, a batch of writes, a (re)connection
STORE_CALLS = ("read", "write", "connect")
STORE_ENTRIES = ("placement", "pending", "load", "answers", "index")  # what a read may find malformed or out of bounds
DECISION_SECONDS = (25e-6, 50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 3.2e-3, 6.4e-3, 0.0128)
PREDICTION_ERROR = (-4096, -1024, -256, -64, -16, -1, 0, 1, 16, 64, 256, 1024, 4096)


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """One replica as the service sees it now (the gateway's replica_states)."""

    name: str
    address: str
    healthy: bool  # False once a request failed there, until /health answers again
    in_flight_requests: int
    in_flight_tokens: int


LiveState = Callable[[], Sequence[ReplicaState]]
LearntSpeeds = Callable[[], Mapping[str, Speed]]  # the router's learnt speed of each replica


class Histogram:
    """Counts per bucket (value <= bound), the +Inf bucket last."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        counts = list(self.counts)  # a copy: the event loop keeps counting while this is scraped
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=self.sum)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.decisions: Counter[tuple[str, str]] = Counter()  # (policy, reason)
        self.completed: Counter[str] = Counter({outcome: 0 for outcome in OUTCOMES})
        self.errors: Counter[str] = Counter({kind: 0 for kind in ERRORS})
        self.stream_failures: Counter[str] = Counter({stream: 0 for stream in STREAMS})  # bugs of ours
        self.predicted_cached: Counter[str] = Counter()  # per replica that served
        self.actual_cached: Counter[str] = Counter()
        self.actual_prompt: Counter[str] = Counter()
        self.released_by_next_turn = 0  # released when a later turn showed the answer (gateway.py)
        self.branches = 0  # chats placed where a completed request they resend was served (Conversations.branch)
        self.answered_locally: Counter[str] = Counter({kind: 0 for kind in LOCAL_ANSWERS})
        self.store_errors: Counter[str] = Counter({call: 0 for call in STORE_CALLS})  # failed or timed out
        self.store_in_use = False  # a store is configured and answering (store.py)
        self.store_invalid: Counter[str] = Counter({kind: 0 for kind in STORE_ENTRIES})  # skipped when read
        self.store_writes_dropped = 0  # queued writes given up during a long outage
        self.store_republished = 0  # times this router published its state again (reconnected, store emptied)
        self.store_answers_learnt = 0  # other routers' answers this router learnt replica speeds from
        self.store_index_applied = 0  # other routers' changes to the prefix index made in this router's
        self.store_index_missed = 0  # entries of their changes trimmed from the store before this router read them
        self.decision_seconds = Histogram(DECISION_SECONDS)
        self.prediction_error = Histogram(PREDICTION_ERROR)
        self.live_state: LiveState = tuple  # no replicas until watch() names the source
        self.learnt_speeds: LearntSpeeds = dict
        self.tokenizer_name = ""  # how prompt tokens are counted (tokens.TokenCounter.name)
        self.registry.register(_Collector(self))

    def tokenizer(self, name: str) -> None:
        self.tokenizer_name = name

    def decision(self, policy: str, reason: str, seconds: float) -> None:
        self.decisions[policy, reason] += 1
        self.decision_seconds.observe(seconds)

    def cache_tokens(self, replica: str, predicted: int, cached: int, prompt: int) -> None:
        """One request's predicted vs reported cached tokens (replica = where it was served)."""
        self.predicted_cached[replica] += predicted
        self.actual_cached[replica] += cached
        self.actual_prompt[replica] += prompt
        self.prediction_error.observe(cached - predicted)

    def watch(self, live_state: LiveState, learnt_speeds: LearntSpeeds = dict) -> None:
        """Expose the replicas' live state (in-flight load, health) and learnt speeds at scrape time."""
        self.live_state = live_state
        self.learnt_speeds = learnt_speeds


class _Collector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        yield from _decisions(m)
        yield from _store(m)
        yield from _cache_tokens(m)
        if m.tokenizer_name:
            tokenizer = GaugeMetricFamily("llm_ring_tokenizer", "1, labelled with how prompt tokens are counted "
                                          "(service.tokenizer: chars/N or gguf:FILE)", labels=["tokenizer"])
            tokenizer.add_metric([m.tokenizer_name], 1)
            yield tokenizer
        yield from _live_state(m.live_state())
        yield from _speeds(m.learnt_speeds())


def _decisions(m: Metrics) -> Iterator[Metric]:
    """What the router decided and how each request ended."""
    yield _counter("llm_ring_decisions", "routing decisions", ["policy", "reason"], m.decisions)
    yield m.decision_seconds.family(
        "llm_ring_decision_seconds", "time to parse the body and decide (router.route included)"
    )
    yield _counter("llm_ring_requests_completed", "requests released from the ledger", ["outcome"], m.completed)
    yield _counter("llm_ring_errors", "requests refused or failed", ["kind"], m.errors)
    yield _total(
        "llm_ring_released_by_next_turn",
        "requests released when a later turn of their conversation arrived carrying their answer",
        m.released_by_next_turn,
    )
    yield _total(
        "llm_ring_branches", "chats that continue no known conversation but resend a completed request's "
        "history (an edited or regenerated turn), started where that history was served", m.branches)
    yield _counter("llm_ring_answered_locally", "read-only requests the gateway answered itself (no replica)",
                   ["kind"], m.answered_locally)
    yield _counter(
        "llm_ring_stream_failures",
        "gRPC streams (or access log entries) the service failed on: a bug; Envoy fails open",
        ["stream"],
        m.stream_failures,
    )


def _store(m: Metrics) -> Iterator[Metric]:
    """The shared store's health (store.py)."""
    yield _counter(
        "llm_ring_store_errors",
        "calls to the shared store that failed or timed out (a read: that decision on local state; "
        "a write: sent again)",
        ["call"],
        m.store_errors,
    )
    yield _counter(
        "llm_ring_store_invalid_entries",
        "entries read from the store that did not parse or were out of bounds: skipped",
        ["entry"],
        m.store_invalid,
    )
    yield _total(
        "llm_ring_store_writes_dropped", "queued store writes given up during a long outage (queue full)",
        m.store_writes_dropped,
    )
    yield _total(
        "llm_ring_store_republished", "times this router published its load, pending requests and placements "
        "again (reconnected, or the store found emptied)", m.store_republished
    )
    yield _total(
        "llm_ring_store_answers_learnt", "other routers' answers this router learnt replica speeds from "
        "(read from the store)", m.store_answers_learnt
    )
    yield _total(
        "llm_ring_store_index_changes_applied", "other routers' changes to llm-aware's prefix index (a prompt "
        "sent, used or failed, a capacity moved) this router made in its own (read from the store)",
        m.store_index_applied)
    yield _total(
        "llm_ring_store_index_entries_missed", "entries of other routers' changes to the prefix index trimmed "
        "from the store before this router read them (its index lacks them)", m.store_index_missed)
    in_use = GaugeMetricFamily(
        "llm_ring_store_in_use", "1 while decisions use the shared store, 0 on local state alone"
    )
    in_use.add_metric([], 1 if m.store_in_use else 0)
    yield in_use


def _cache_tokens(m: Metrics) -> Iterator[Metric]:
    """The cached prompt tokens predicted against those the replicas reported."""
    yield _counter(
        "llm_ring_predicted_cached_tokens",
        "cached prompt tokens the router predicted (requests with timings)",
        ["replica"],
        m.predicted_cached,
    )
    yield _counter(
        "llm_ring_actual_cached_tokens",
        "cached prompt tokens the replica reported (timings.cache_n)",
        ["replica"],
        m.actual_cached,
    )
    yield _counter(
        "llm_ring_actual_prompt_tokens",
        "prompt tokens the replica reported (cache_n + prompt_n)",
        ["replica"],
        m.actual_prompt,
    )
    yield m.prediction_error.family(
        "llm_ring_cached_tokens_prediction_error", "actual cache_n minus predicted cached tokens, per request"
    )


def _total(name: str, documentation: str, value: float) -> Metric:
    """A counter without labels."""
    family = CounterMetricFamily(name, documentation)
    family.add_metric([], value)
    return family


def _counter(
    name: str, documentation: str, labels: list[str], counts: Counter[str] | Counter[tuple[str, str]]
) -> Metric:
    family = CounterMetricFamily(name, documentation, labels=labels)
    for key, value in dict(counts).items():  # a copy, as above
        family.add_metric(list(key) if isinstance(key, tuple) else [key], value)
    return family


def _live_state(replicas: Sequence[ReplicaState]) -> Iterator[Metric]:
    requests = GaugeMetricFamily("llm_ring_in_flight_requests", "requests in flight per replica", labels=["replica"])
    tokens = GaugeMetricFamily("llm_ring_in_flight_tokens", "tokens charged in flight per replica", labels=["replica"])
    healthy = GaugeMetricFamily(
        "llm_ring_replica_healthy",
        "1 unless a request failed there and /health has not answered since",
        labels=["replica"],
    )
    for replica in replicas:
        requests.add_metric([replica.name], replica.in_flight_requests)
        tokens.add_metric([replica.name], replica.in_flight_tokens)
        healthy.add_metric([replica.name], 1 if replica.healthy else 0)
    yield requests
    yield tokens
    yield healthy


def _speeds(speeds: Mapping[str, Speed]) -> Iterator[Metric]:
    """The router's learnt speed of each replica (routing/speeds.py)."""
    families = (
        GaugeMetricFamily("llm_ring_replica_prefill_tokens_per_second", "learnt prefill speed per replica",
                          labels=["replica"]),
        GaugeMetricFamily("llm_ring_replica_decode_tokens_per_second", "learnt decode speed per replica",
                          labels=["replica"]),
        GaugeMetricFamily("llm_ring_replica_request_overhead_seconds", "learnt fixed prefill cost per request",
                          labels=["replica"]),
    )
    for name, speed in speeds.items():
        for family, value in zip(families, (1 / speed.prefill_s_per_token, 1 / speed.decode_s_per_token,
                                            speed.overhead_s), strict=True):
            family.add_metric([name], value)
    yield from families
