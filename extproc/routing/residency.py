"""Which models each replica holds in memory: llama.cpp's router mode and sleep as locality.

A llama-server in router mode (``--models-dir`` or ``--models-preset``) runs each model in a
child process it starts on demand. A request for a model that is not loaded waits for its load
(seconds); past ``--models-max`` the least recently used idle model is unloaded, and its KV
cache with it. A server with ``--sleep-idle-seconds`` unloads its model and cache when idle, and
the next request waits for the wake. To a router both are locality, as the prompt cache is:

- ``penalty(replica, model)``: the seconds a request waits there before its prefill starts.
  0 when the model is loaded, or when the replica reports no statuses (a one-model server
  without sleep: nothing changes). The load time when the model is unloaded, half of it while it
  loads, and the wake time when it sleeps. A load on a replica at its capacity in models is charged one load
  more: the evicted model's conversations load it again when they come back.
- ``cold(replica, model)``: the model sleeps or is not loaded there, so its cache counts as empty.

What it knows comes from the replicas' reports (``observe``: each model's status, from
``/models`` and its events) and, between reports, from the router's own sends (``sent``: a
request makes its model loaded and most recently used; past the capacity, the least recently
used of the others is taken as unloaded). Load and wake times are learnt from the reports
(``learn``: the seconds from "loading" to "loaded"), an exponentially weighted mean starting
at the prior. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final, Literal

Status = Literal["loaded", "loading", "sleeping", "unloaded"]
STATUSES: Final = frozenset(("loaded", "loading", "sleeping", "unloaded"))
LEARNING_WEIGHT: Final = 0.3  # the newest measured load's weight in the learnt time


class Residency:
    def __init__(self, load_s: float, wake_s: float) -> None:
        self.load_s = load_s  # learnt: a model's load, "loading" to "loaded"
        self.wake_s = wake_s  # learnt: a sleeping model's wake
        # replica -> model -> status, least recently used first (only replicas that report statuses)
        self._models: dict[str, dict[str, Status]] = {}
        self._capacity: dict[str, int] = {}  # replica -> models it keeps loaded at once (0: no limit)
        self.tracked = False  # some replica reports statuses: the policies look (the common path does not)

    def set_replicas(self, replicas: Iterable[str]) -> None:
        names = frozenset(replicas)
        self._models = {name: models for name, models in self._models.items() if name in names}
        self._capacity = {name: capacity for name, capacity in self._capacity.items() if name in names}
        self.tracked = bool(self._models)

    def observe(self, replica: str, statuses: Mapping[str, Status], capacity: int) -> None:
        """A replica's report: each of its models' status, and how many it keeps loaded (0: no limit).
        The order of use the router saw is kept for the models it already knew."""
        known = self._models.get(replica, {})
        ordered = {model: statuses[model] for model in known if model in statuses}
        ordered.update((model, status) for model, status in statuses.items() if model not in ordered)
        self._models[replica] = ordered
        self._capacity[replica] = capacity
        self.tracked = True

    def status_changed(self, replica: str, model: str, status: Status) -> None:
        """One model's new status, as the replica's event stream reports it."""
        models = self._models.get(replica)
        if models is not None:
            models[model] = status

    def sent(self, replica: str, model: str) -> str | None:
        """A request for ``model`` went to ``replica``: the model it predicts unloaded there, if any."""
        models = self._models.get(replica)
        if models is not None and not model and len(models) == 1:
            model = next(iter(models))
        if models is None or model not in models:
            return None
        before = models.pop(model)
        models[model] = "loaded" if before != "loading" else before  # most recently used
        capacity = self._capacity.get(replica, 0)
        running = [name for name, status in models.items() if status != "unloaded"]
        if before != "unloaded" or not capacity or len(running) <= capacity:  # no load, or room for it
            return None
        evicted = running[0]  # the least recently used (the one just sent is last)
        models[evicted] = "unloaded"
        return evicted

    def status(self, replica: str, model: str) -> Status:
        """``model``'s status on ``replica`` ("loaded" when the replica reports none, or not this
        model); a request naming no model asks for a one-model replica's model."""
        models = self._models.get(replica)
        if not models:
            return "loaded"
        if not model and len(models) == 1:
            return next(iter(models.values()))
        return models.get(model, "loaded")

    def cold(self, replica: str, model: str) -> bool:
        return self.status(replica, model) != "loaded"

    def penalty(self, replica: str, model: str) -> float:
        status = self.status(replica, model)
        if status == "loaded":
            return 0.0
        if status == "sleeping":
            return self.wake_s
        if status == "loading":  # under way: half of it left, on average, and no other model evicted
            return self.load_s / 2
        capacity, models = self._capacity.get(replica, 0), self._models[replica]
        full = capacity and sum(1 for name, held in models.items() if held != "unloaded" and name != model) >= capacity
        return 2 * self.load_s if full else self.load_s

    def learn(self, kind: Literal["load", "wake"], seconds: float) -> None:
        if seconds < 0:
            return
        if kind == "load":
            self.load_s += LEARNING_WEIGHT * (seconds - self.load_s)
        else:
            self.wake_s += LEARNING_WEIGHT * (seconds - self.wake_s)

    def statuses(self, replica: str) -> dict[str, Status]:
        """What the router believes of ``replica``'s models (a copy; empty when it reports none)."""
        return dict(self._models.get(replica, {}))
