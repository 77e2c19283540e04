"""Shared by the Kubernetes discovery tests: a reader of a source's snapshots, waiting, the
requests the fake API server saw."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from fake_apiserver import FakeApiServer

from extproc.discovery import Discovery


class Reader:
    """Consumes discovery.snapshots() in a task; also measures the loop's worst stall."""

    def __init__(self, discovery: Discovery) -> None:
        self.snapshots: list[dict[str, str]] = []
        self.max_stall = 0.0
        self._task = asyncio.create_task(self._read(discovery))
        self._ticker = asyncio.create_task(self._tick())

    async def _read(self, discovery: Discovery) -> None:
        async for snapshot in discovery.snapshots():
            self.snapshots.append(snapshot)

    async def _tick(self) -> None:
        while True:
            start = time.monotonic()
            await asyncio.sleep(0.01)
            self.max_stall = max(self.max_stall, time.monotonic() - start - 0.01)

    async def until(self, expected: dict[str, str], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.snapshots or self.snapshots[-1] != expected:
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {timeout}s for {expected}; got {self.snapshots}")
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        for task in (self._task, self._ticker):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def wait(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def requests_of(server: FakeApiServer, verb: str, status: int | None = None) -> list[Any]:
    return [r for r in server.requests if r.verb == verb and (status is None or r.status == status)]
