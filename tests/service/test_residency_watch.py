"""The router's picture of loaded models follows a router-mode replica's own reports.

The replica here is a loopback HTTP server answering with llama-server's router-mode shapes
(tools/server/server-models.cpp: GET /props, /v1/models, /models/sse); the live router-mode
fleet is measured by scripts/measure-model-loads (docs/fleets.md)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import orjson
import pytest

from extproc.routing.residency import Residency
from extproc.service.residency_watch import ResidencyWatcher, parse_event, parse_statuses

MODELS = orjson.dumps({"object": "list", "data": [
    {"id": "smollm2", "aliases": [], "object": "model", "owned_by": "llamacpp", "created": 1,
     "status": {"value": "loaded", "args": ["llama-server", "--port", "41234"]}},
    {"id": "tiny", "object": "model", "status": {"value": "unloaded", "args": []}},
    {"id": "odd", "object": "model", "status": {"value": "downloading"}},
]})


def test_statuses_and_events_are_read_from_llama_servers_shapes() -> None:
    assert parse_statuses(MODELS) == {"smollm2": "loaded", "tiny": "unloaded"}
    with pytest.raises(ValueError, match="no 'data' list"):
        parse_statuses(b'{"object": "list"}')
    line = b'data: {"model": "tiny", "event": "status_change", "data": {"status": "loading"}}'
    assert parse_event(line) == ("tiny", "loading")
    assert parse_event(b'data: {"model": "tiny", "event": "x", "data": {"status": "melting"}}') is None
    assert parse_event(b"data: not json") is None and parse_event(b": keep-alive") is None


async def serve(role: str, events: asyncio.Queue[bytes]) -> asyncio.Server:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        path = (await reader.readuntil(b"\r\n\r\n")).split(b" ")[1]
        if path == b"/models/sse":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            while True:
                event = b"data: " + await events.get() + b"\n\n"
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
        body = orjson.dumps({"role": role, "max_instances": 1}) if path == b"/props" else MODELS
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", 0)


async def until(check: Callable[[], bool], seconds: float = 5.0) -> None:
    async with asyncio.timeout(seconds):
        while not check():
            await asyncio.sleep(0.01)


def test_a_router_mode_replica_is_followed_and_its_loads_learnt() -> None:
    asyncio.run(followed())


def test_a_one_model_replica_is_left_alone() -> None:
    asyncio.run(left_alone())


async def followed() -> None:
    events: asyncio.Queue[bytes] = asyncio.Queue()
    server = await serve("router", events)
    residency = Residency(1.5, 1.0)
    port = server.sockets[0].getsockname()[1]
    watcher = ResidencyWatcher(lambda: residency, lambda: {"llm-0": f"127.0.0.1:{port}"}, resync_seconds=30)
    try:
        watcher.replicas_changed()
        await until(lambda: residency.statuses("llm-0") == {"smollm2": "loaded", "tiny": "unloaded"})
        assert residency.penalty("llm-0", "tiny") == 3.0  # models_max 1 from /props: a load that evicts
        for status in (b"loading", b"loading", b"loaded"):  # the load begins, progresses, ends
            await events.put(b'{"model": "tiny", "event": "status_change", "data": {"status": "%s"}}' % status)
            await asyncio.sleep(0.2)
        await until(lambda: residency.statuses("llm-0")["tiny"] == "loaded")
        assert 0.3 * 0.4 + 0.7 * 1.5 - 0.05 < residency.load_s < 1.5  # learnt from the first event on: ~0.4 s
    finally:
        await watcher.close()
        server.close()


async def left_alone() -> None:
    server = await serve("", asyncio.Queue())
    residency = Residency(1.5, 1.0)
    port = server.sockets[0].getsockname()[1]
    watcher = ResidencyWatcher(lambda: residency, lambda: {"llm-0": f"127.0.0.1:{port}"})
    try:
        watcher.replicas_changed()
        await until(lambda: watcher._tasks["llm-0"].done())
        assert not residency.tracked
    finally:
        await watcher.close()
        server.close()


def test_a_one_model_replica_is_followed_once_it_sleeps() -> None:
    asyncio.run(asleep_then_awake())


async def asleep_then_awake() -> None:
    state = {"is_sleeping": False, "model_alias": "/data/models/tiny.gguf"}

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = orjson.dumps(state)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    residency = Residency(1.5, 1.0)
    port = server.sockets[0].getsockname()[1]
    watcher = ResidencyWatcher(lambda: residency, lambda: {"llm-0": f"127.0.0.1:{port}"}, resync_seconds=0.05)
    try:
        watcher.replicas_changed()
        await asyncio.sleep(0.3)
        assert not residency.tracked  # awake since it started: nothing to tell
        state["is_sleeping"] = True
        await until(lambda: residency.status("llm-0", "tiny") == "sleeping")
        assert residency.penalty("llm-0", "") == 1.0 and residency.cold("llm-0", "")  # a request naming no model
        state["is_sleeping"] = False
        await until(lambda: residency.status("llm-0", "tiny") == "loaded")
    finally:
        await watcher.close()
        server.close()
