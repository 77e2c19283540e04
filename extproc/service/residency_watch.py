"""Keeps the router's picture of loaded models (routing/residency.py) in step with the replicas.

A llama-server in router mode says so in ``GET /props`` (``"role": "router"``, ``max_instances``:
its ``--models-max``), lists each model's status in ``GET /v1/models`` (``status.value``) and
streams every change on ``GET /models/sse`` (``{"model", "event", "data": {"status"}}``). For each
such replica one task reads the list, then follows the stream; the list is read again every
``resync_seconds`` and whenever the stream ends, so a lost event is corrected. The seconds from
a model's first "loading" event to its "loaded" one are learnt as the load time. A one-model
replica says in ``GET /props`` whether it sleeps (``is_sleeping``, with ``--sleep-idle-seconds``):
that is read every ``resync_seconds``, and told to the router from the first time it sleeps
(until then nothing changes for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping

import httpx
import orjson
import structlog

from extproc.routing.residency import STATUSES, Residency, Status
from extproc.service.catalog import model_list, per_replica, read_model_list, served_name

log = structlog.get_logger("extproc.service.residency_watch")

MAX_EVENT_BYTES = 1 << 16


def parse_statuses(body: bytes) -> dict[str, Status]:
    """Each model's status in a router-mode model list; ValueError when it is not one."""
    statuses: dict[str, Status] = {}
    for item in model_list(body):
        status = item.get("status") if isinstance(item, dict) else None
        value = status.get("value") if isinstance(status, dict) else None
        if isinstance(item.get("id"), str) and value in STATUSES:
            statuses[item["id"]] = value
    return statuses


def parse_event(line: bytes) -> tuple[str, Status] | None:
    """(model, its new status) of one ``data:`` line of the event stream; None for any other line."""
    if not line.startswith(b"data:") or len(line) > MAX_EVENT_BYTES:
        return None
    try:
        event = orjson.loads(line[5:])
    except orjson.JSONDecodeError:
        return None
    data = event.get("data") if isinstance(event, dict) else None
    status = data.get("status") if isinstance(data, dict) else None
    model = event.get("model") if isinstance(event, dict) else None
    return (model, status) if isinstance(model, str) and status in STATUSES else None


class ResidencyWatcher:
    def __init__(self, residency: Callable[[], Residency], endpoints: Callable[[], Mapping[str, str]],
                 replica_key: str | None = None, resync_seconds: float = 5.0, timeout_seconds: float = 2.0) -> None:
        """residency: the router's, read when needed (a reset may replace the router's objects)."""
        self.residency = residency
        self.endpoints = endpoints  # the gateway's replica name -> "host:port"
        self.resync = resync_seconds
        key = {"authorization": f"Bearer {replica_key}"} if replica_key else {}
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_seconds, read=None), headers=key)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._loading: dict[tuple[str, str], float] = {}  # (replica, model) -> when its load began

    def replicas_changed(self) -> None:
        per_replica(self._tasks, self.endpoints(), self._watch, lambda name: name not in self._tasks)

    async def _watch(self, name: str) -> None:
        props = await self._first_props(name)
        if props is None:
            return
        capacity = props.get("max_instances")
        if props.get("role") == "router" and type(capacity) is int:
            log.info("replica_router_mode", replica=name, models_max=capacity)
            await self._follow_router(name, max(0, capacity))
        elif "is_sleeping" in props:
            await self._follow_sleep(name)

    async def _follow_router(self, name: str, capacity: int) -> None:
        while (endpoint := self.endpoints().get(name)) is not None:
            statuses = await self._list(endpoint)
            if statuses is not None:
                self.residency().observe(name, statuses, capacity)
            began = time.monotonic()
            with contextlib.suppress(httpx.HTTPError, TimeoutError):
                async with asyncio.timeout(self.resync):
                    await self._follow(name, endpoint)
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - began)))  # a refused stream: not a busy loop

    async def _follow_sleep(self, name: str) -> None:
        slept = False
        while (endpoint := self.endpoints().get(name)) is not None:
            props = await self._props(endpoint)
            asleep = props is not None and props.get("is_sleeping") is True
            if props is not None and (slept or asleep):
                model = served_name(str(props.get("model_alias") or props.get("model_path") or ""))
                if asleep != (self.residency().status(name, model) == "sleeping"):
                    log.info("replica_sleep", replica=name, model=model, sleeping=asleep)
                slept = True
                self.residency().observe(name, {model: "sleeping" if asleep else "loaded"}, 0)
            await asyncio.sleep(self.resync)

    async def _first_props(self, name: str) -> dict[str, object] | None:
        """The replica's ``GET /props``, asked until it answers; None once it has left."""
        while (endpoint := self.endpoints().get(name)) is not None:
            props = await self._props(endpoint)
            if props is not None:
                return props
            await asyncio.sleep(1.0)
        return None

    async def _props(self, endpoint: str) -> dict[str, object] | None:
        try:
            response = await self.client.get(f"http://{endpoint}/props")
            props = orjson.loads(response.content) if response.status_code == 200 else None
        except (httpx.HTTPError, orjson.JSONDecodeError):
            return None
        return props if isinstance(props, dict) else None

    async def _list(self, endpoint: str) -> dict[str, Status] | None:
        return await read_model_list(self.client, endpoint, parse_statuses, "replica_model_statuses_unreadable")

    async def _follow(self, name: str, endpoint: str) -> None:
        async with self.client.stream("GET", f"http://{endpoint}/models/sse") as response:
            async for line in response.aiter_lines():
                changed = parse_event(line.encode())
                if changed is not None:
                    self._changed(name, *changed)

    def _changed(self, replica: str, model: str, status: Status) -> None:
        residency, now = self.residency(), time.monotonic()
        residency.status_changed(replica, model, status)
        if status == "loading":  # one event when the load begins, more as it progresses
            self._loading.setdefault((replica, model), now)
        elif (began := self._loading.pop((replica, model), None)) is not None and status == "loaded":
            residency.learn("load", now - began)
            log.info("replica_model_loaded", replica=replica, model=model, seconds=round(now - began, 3))

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await self.client.aclose()
