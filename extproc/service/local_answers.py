"""The gateway's own answers: what Envoy answers the client without a replica (a read-only
request, a refused path, a CORS preflight, a model not served, no replica to go to)."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.envoy.cors import CorsPolicy
from extproc.envoy.surface import ReadOnly, Refused
from extproc.service.answers import immediate, local_answer
from extproc.service.bounds import bounded
from extproc.service.catalog import ModelCatalog
from extproc.service.fleet import Fleet
from extproc.service.metrics import Metrics


class LocalAnswers:
    def __init__(self, fleet: Fleet, catalog: ModelCatalog, cors: CorsPolicy, metrics: Metrics) -> None:
        self.fleet = fleet
        self.catalog = catalog
        self.cors = cors
        self.metrics = metrics

    def answer(self, asked: ReadOnly, headers: Sequence[tuple[str, str]] = ()) -> bytes:
        """The answer to a read-only request (surface.py): the fleet's models, one model, or its
        health (200 while a replica is healthy). ``headers``: CORS, when allowed."""
        self.metrics.answered_locally[asked.kind] += 1
        if asked.kind == "models":
            return local_answer(200, self.catalog.listing(), headers)
        if asked.kind == "model":
            entry = self.catalog.entry(asked.model)
            if entry is None:
                return self.model_not_found(asked.model, headers)
            return local_answer(200, entry, headers)
        fleet = self.fleet
        if any(name not in fleet.unhealthy for name in fleet.endpoints):
            return local_answer(200, b'{"status":"ok"}', headers)
        return immediate(503, "no replica available", "no_replica", headers=headers)

    def refuse(self, refused: Refused, headers: Sequence[tuple[str, str]] = ()) -> bytes:
        """404 for a path the gateway does not serve, 405 for a method it does not take there."""
        self.metrics.errors["refused_path"] += 1
        allow = [("allow", refused.allow)] if refused.allow else []
        return immediate(refused.status, refused.message, refused.code, headers=[*allow, *headers])

    def preflight(self, cors: Sequence[tuple[str, str]], requested_headers: str) -> bytes:
        """A CORS preflight from an allowed origin (``cors``: its answer headers)."""
        self.metrics.answered_locally["preflight"] += 1
        return local_answer(204, b"", [*cors, *self.cors.preflight_headers(requested_headers)])

    def model_not_found(self, model: str, headers: Sequence[tuple[str, str]] = ()) -> bytes:
        self.metrics.errors["unknown_model"] += 1
        served = ", ".join(entry.id for entry in self.catalog.entries()) or "none known yet"
        return immediate(404, f"the model {bounded(model)!r} is not served here (served: {served})",
                         "model_not_found", "model", headers)

    def model_not_ready(self, model: str) -> bytes:
        """A model a replica served, none of whose replicas is in the fleet now."""
        self.metrics.errors["no_replica"] += 1
        return immediate(503, f"the model {bounded(model)!r} has no ready replica: retry shortly", "no_replica",
                         "model")

    def no_replica(self, subset: frozenset[str] | None) -> bytes:
        self.metrics.errors["no_replica"] += 1
        fleet = self.fleet
        if subset is not None:
            return immediate(503, f"no replica of the gateway's subset is available ({len(subset)} endpoints named, "
                             f"{len(fleet.endpoints)} replicas known)", "no_replica")
        return immediate(503, f"no replica available ({len(fleet.endpoints)} known, {len(fleet.unhealthy)} "
                         "unhealthy)", "no_replica")
