"""The fleet's models: what each replica serves, as its own ``GET /v1/models`` says.

The gateway answers ``GET /v1/models`` and ``/v1/models/{id}`` from it (OpenAI's list shape, one
entry per model id however many replicas serve it), refuses a generation naming a model no
replica serves (404 ``model_not_found``), and routes a named model only to the replicas serving
it. A replica not heard from yet may serve anything: until every replica has answered, a model
is refused only when no replica could serve it. A model some replica served, whose replicas are
all gone (scaled in, restarting, not ready), is still known: 503 until one serves it again.
``ModelCatalog`` is pure; ``ModelFetcher`` asks each new replica (retrying while it loads) and
feeds the catalog.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, TypeVar

import httpx
import orjson
import structlog

log = structlog.get_logger("extproc.service.catalog")
T = TypeVar("T")

MAX_MODELS_BYTES = 1 << 20  # a replica's model list larger than this is not read
MAX_MODEL_ID_CHARS = 256
ELIGIBLE_KEPT = 256  # model names asked for whose eligible replicas are kept (clients choose the names)
KNOWN_KEPT = 1024  # model names (served and reported) remembered once their replicas are gone


@dataclass(frozen=True, slots=True)
class ModelEntry:
    id: str  # the served name: the replica's alias (llama-server --alias), or its file's stem
    created: int
    owned_by: str
    reported: str  # the id as the replica reports it (a file path when it has no alias)

    def as_openai(self) -> dict[str, object]:
        return {"id": self.id, "object": "model", "created": self.created, "owned_by": self.owned_by}


def served_name(reported: str) -> str:
    """A sensible id for a model: a GGUF path becomes its file's stem ("/m/smollm2.gguf" -> "smollm2")."""
    return PurePosixPath(reported).stem if reported.endswith(".gguf") else reported


def model_list(body: bytes) -> list[Any]:
    """The items of an OpenAI model list (``{"data": [{"id": ...}, ...]}``); ValueError if it is none."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        raise ValueError("no 'data' list")
    return data


async def read_model_list(client: httpx.AsyncClient, endpoint: str, parse: Callable[[bytes], T],
                          unreadable: str) -> T | None:
    """A replica's ``GET /v1/models`` as ``parse`` reads it; None when it does not answer 200, is
    larger than MAX_MODELS_BYTES, or cannot be read (logged as ``unreadable``)."""
    try:
        response = await client.get(f"http://{endpoint}/v1/models")
    except httpx.HTTPError:
        return None
    if response.status_code != 200 or len(response.content) > MAX_MODELS_BYTES:
        return None
    try:
        return parse(response.content)
    except ValueError as exc:
        log.warning(unreadable, endpoint=endpoint, error=str(exc)[:200])
        return None


def per_replica(tasks: dict[str, asyncio.Task[None]], replicas: Collection[str],
                start: Callable[[str], Coroutine[Any, Any, None]], wanted: Callable[[str], bool]) -> None:
    """One task a replica: those of replicas gone are cancelled; ``start`` runs for each replica
    ``wanted`` says needs one."""
    for name in list(tasks):
        if name not in replicas:
            tasks.pop(name).cancel()
    loop = asyncio.get_running_loop()
    for name in replicas:
        if wanted(name):
            tasks[name] = loop.create_task(start(name))


def parse_models(body: bytes) -> tuple[ModelEntry, ...]:
    """The entries of an OpenAI model list; ValueError if it is none."""
    entries = []
    for item in model_list(body):
        reported = item.get("id") if isinstance(item, dict) else None
        if not isinstance(reported, str) or not reported or len(reported) > MAX_MODEL_ID_CHARS:
            continue
        created = item.get("created")
        owner = item.get("owned_by")
        entries.append(ModelEntry(served_name(reported), created if type(created) is int else 0,
                                  owner if isinstance(owner, str) else "llamacpp", reported))
    return tuple(entries)


class ModelCatalog:
    """Replica -> the models it serves (module docstring)."""

    def __init__(self) -> None:
        self._replicas: frozenset[str] = frozenset()  # the gateway's replica set
        self._served: dict[str, tuple[ModelEntry, ...]] = {}
        self._eligible: dict[str, frozenset[str]] = {}  # per model asked for, until the catalog changes
        self._known: dict[str, None] = {}  # every name a replica served a model under, oldest first

    def set_replicas(self, replicas: Collection[str]) -> None:
        self._replicas = frozenset(replicas)
        self._served = {name: entries for name, entries in self._served.items() if name in self._replicas}
        self._eligible.clear()

    def learn(self, replica: str, entries: tuple[ModelEntry, ...]) -> None:
        if replica in self._replicas:
            self._served[replica] = entries
            self._eligible.clear()
            for entry in entries:
                for name in (entry.id, entry.reported):
                    self._known.pop(name, None)  # re-inserted as the newest
                    self._known[name] = None
            while len(self._known) > KNOWN_KEPT:
                del self._known[next(iter(self._known))]

    def known(self, model: str) -> bool:
        """Whether a replica served ``model`` (by its served name or as reported), now or before."""
        return model in self._known

    def knows(self, replica: str) -> bool:
        return replica in self._served

    def entries(self) -> list[ModelEntry]:
        """One entry per served id, in id order."""
        unique: dict[str, ModelEntry] = {}
        for entries in self._served.values():
            for entry in entries:
                unique.setdefault(entry.id, entry)
        return [unique[name] for name in sorted(unique)]

    def eligible(self, model: str) -> frozenset[str]:
        """The replicas a request naming ``model`` may go to: those serving it by its served name
        or as reported, and those not heard from yet. No model named: all of them."""
        if not model:
            return self._replicas
        found = self._eligible.get(model)
        if found is None:
            if len(self._eligible) >= ELIGIBLE_KEPT:
                self._eligible.clear()
            found = self._eligible[model] = frozenset(
                name for name in self._replicas
                if name not in self._served or any(model in (e.id, e.reported) for e in self._served[name]))
        return found

    def listing(self) -> bytes:
        return orjson.dumps({"object": "list", "data": [entry.as_openai() for entry in self.entries()]})

    def entry(self, model: str) -> bytes | None:
        for entry in self.entries():
            if model in (entry.id, entry.reported):
                return orjson.dumps(entry.as_openai())
        return None


class ModelFetcher:
    """Asks each replica for its models once it appears, every ``retry_seconds`` until it answers
    (a replica loading its model answers 503); forgets replicas discovery removed."""

    def __init__(self, catalog: ModelCatalog, endpoints: Callable[[], Mapping[str, str]],
                 replica_key: str | None = None, retry_seconds: float = 1.0, timeout_seconds: float = 2.0) -> None:
        """replica_key: the replicas' API key (service.replica_api_key_file), None when they want none."""
        self.catalog = catalog
        self.endpoints = endpoints  # the gateway's replica name -> "host:port", read when needed
        self.retry = retry_seconds
        key = {"authorization": f"Bearer {replica_key}"} if replica_key else {}
        self.client = httpx.AsyncClient(timeout=timeout_seconds, headers=key)
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def replicas_changed(self) -> None:
        """Discovery gave a new replica set: ask the new replicas, forget the removed ones."""
        tasks = self._tasks
        per_replica(tasks, self.endpoints(), self._ask,
                    lambda name: not self.catalog.knows(name) and (name not in tasks or tasks[name].done()))

    async def _ask(self, name: str) -> None:
        while (endpoint := self.endpoints().get(name)) is not None:
            entries = await self._fetch(endpoint)
            if entries is not None:
                self.catalog.learn(name, entries)
                log.info("replica_models", replica=name, models=[entry.id for entry in entries])
                return
            await asyncio.sleep(self.retry)

    async def _fetch(self, endpoint: str) -> tuple[ModelEntry, ...] | None:
        return await read_model_list(self.client, endpoint, parse_models, "replica_models_unreadable")

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await self.client.aclose()
