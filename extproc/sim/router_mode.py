"""llama.cpp's router mode in the simulator: each replica serves several models, ``models_max`` at once.

As llama-server with ``--models-dir`` and ``--models-max`` (tools/server/server-models.cpp):

- a request for a loaded model goes to the server at once, and makes it the most recently used;
- a request for a model that is not loaded waits: its model joins the queue of models to load
  (one entry per model, first come first served). The front of the queue loads when fewer than
  ``models_max`` models run and no other load is under way; while the queue wants more room than
  is free, the least recently used idle model is unloaded (idle: no request in flight on it and
  none queued for it). A model with requests in flight is never unloaded: the queue waits for one
  to end;
- a load takes the model's ``load_s``; an unload is immediate, and the model's prompt cache on
  that replica (its slots and its host-RAM entries: a child process's) goes with it.

The models of one replica share its slots and its CPU (one ``Replica``).

The router's ``Residency`` hears what the service hears from the replicas' ``/models`` and their
events: a snapshot when a replica joins (every model unloaded, its capacity), then each status
change ("loading", "loaded", "unloaded") ``report_lag_s`` later, and each finished load's seconds
(``learn``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

from extproc.routing import Router
from extproc.routing.blocks import model_seed
from extproc.routing.residency import Status
from extproc.sim.driven import Simulation
from extproc.sim.replica import Replica
from extproc.sim.request import Request


@dataclass(frozen=True)
class RouterMode:
    """The fleet's models: each replica a llama-server in router mode serving all of them."""

    shares: Mapping[str, float]  # model -> share of the conversations naming it
    load_s: Mapping[str, float]  # model -> seconds its load takes
    models_max: int  # models a replica keeps loaded at once (llama-server --models-max)
    report_lag_s: float = 0.0  # a status change reaches the router this much later


def model_key(model: str, key: Hashable) -> tuple[int, Hashable]:
    """A conversation's prompt-cache key under its model: two models never share a cache."""
    return (model_seed(model), key)


class ModelServer:
    """One replica's models: status (least recently used first), requests in flight, the load queue."""

    __slots__ = ("capacity", "status", "in_flight", "waiting", "loads")

    def __init__(self, models: Iterable[str], capacity: int) -> None:
        self.capacity = capacity
        self.status: dict[str, Status] = dict.fromkeys(models, "unloaded")
        self.in_flight = dict.fromkeys(self.status, 0)
        self.waiting: dict[str, list[Request]] = {}  # the queue: model -> requests waiting for its load
        self.loads = 0

    def admit(self, request: Request, model: str) -> bool:
        """Whether ``request`` goes to the server now (its model loaded); else it waits for the load."""
        if self.status[model] == "loaded":
            self._use(model)
            self.in_flight[model] += 1
            return True
        self.waiting.setdefault(model, []).append(request)
        return False

    def finished(self, model: str) -> None:
        self.in_flight[model] -= 1

    def step(self) -> tuple[list[str], str | None]:
        """The queue's turn: (models unloaded to make room, the model whose load starts, if any)."""
        status = self.status
        needed = sum(1 for model in self.waiting if status[model] == "unloaded")
        free = self.capacity - sum(1 for held in status.values() if held != "unloaded")
        unloaded = []
        while free < needed:
            victim = next((model for model, held in status.items() if held == "loaded"
                           and not self.in_flight[model] and model not in self.waiting), None)
            if victim is None:
                break  # every loaded model is busy: wait for a request to end
            status[victim] = "unloaded"
            unloaded.append(victim)
            free += 1
        front = next(iter(self.waiting), None)
        if front is None or free <= 0 or "loading" in status.values() or status[front] != "unloaded":
            return unloaded, None
        status[front] = "loading"
        self._use(front)
        self.loads += 1
        return unloaded, front

    def loaded(self, model: str) -> list[Request]:
        """``model``'s load is done: the requests that waited for it, now in flight."""
        self.status[model] = "loaded"
        requests = self.waiting.pop(model, [])
        self.in_flight[model] += len(requests)
        return requests

    def _use(self, model: str) -> None:
        self.status[model] = self.status.pop(model)  # most recently used: last


class SimRouterMode:
    """The engine's side: holds requests for their model's load, unloads, and reports to the routers."""

    def __init__(self, sim: Simulation, spec: RouterMode) -> None:
        self.sim = sim
        self.spec = spec
        self.servers: dict[str, ModelServer] = {}
        self.routers: list[Router] = sim.router.distinct()

    def add(self, replica: str) -> None:
        """A new replica (a fresh server: every model unloaded), as its ``/models`` reports it."""
        server = self.servers[replica] = ModelServer(self.spec.shares, self.spec.models_max)
        for router in self.routers:
            router.residency.observe(replica, dict(server.status), self.spec.models_max)

    def loads(self) -> dict[str, int]:
        return {name: server.loads for name, server in self.servers.items()}

    def arrive(self, request: Request, replica: Replica, now: float) -> None:
        if self.servers[replica.name].admit(request, request.route.model):
            self.sim.serve(request, replica, now)
        else:
            self._step(replica, now)

    def finished(self, request: Request, replica: Replica, now: float) -> None:
        server = self.servers[replica.name]
        server.finished(request.route.model)
        if server.waiting:
            self._step(replica, now)

    def _step(self, replica: Replica, now: float) -> None:
        unloaded, load = self.servers[replica.name].step()
        for model in unloaded:
            replica.forget(model_seed(model))
            self._report(now, replica.name, model, "unloaded")
        if load is not None:
            self._report(now, replica.name, load, "loading")
            self.sim.push_hook(now + self.spec.load_s[load], lambda sim, at: self._loaded(replica, load, at))

    def _loaded(self, replica: Replica, model: str, now: float) -> None:
        self._report(now, replica.name, model, "loaded", self.spec.load_s[model])
        for request in self.servers[replica.name].loaded(model):
            self.sim.serve(request, replica, now)
        self._step(replica, now)

    def _report(self, now: float, replica: str, model: str, status: Status, load_s: float | None = None) -> None:
        """A status event from ``replica``, at the routers ``report_lag_s`` later (with a load's seconds)."""
        def deliver() -> None:
            for router in self.routers:
                router.residency.status_changed(replica, model, status)
                if load_s is not None:
                    router.residency.learn("load", load_s)

        if self.spec.report_lag_s:
            self.sim.push_hook(now + self.spec.report_lag_s, lambda sim, at: deliver())
        else:
            deliver()
