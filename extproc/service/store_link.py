"""The shared store's connection (store.py): the client, each call's time budget, and what a
failure costs: a slow or refused call only itself, a lost link the store's use until a
reconnection."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ConnectionError as LinkError
from redis.exceptions import RedisError

from extproc.service.metrics import Metrics
from extproc.settings import StoreSettings, read_secret_file

log = structlog.get_logger("extproc.service")

FAILURES = (RedisError, OSError, TimeoutError)
MAX_CONNECTIONS = 32  # decisions beyond this wait for a connection (within the timeout)
LAG_EVERY_S = 0.02  # the event loop's lag is sampled this often
LAG_DECAY = 0.9  # ... and remembered as a maximum that decays by this per sample

T = TypeVar("T")


class StoreLink:
    def __init__(self, settings: StoreSettings, router_id: str, metrics: Metrics) -> None:
        self.settings = settings
        self.router_id = router_id
        self.metrics = metrics
        self.timeout = settings.timeout_ms / 1000
        password = read_secret_file("store.password_file", settings.password_file)
        # each call's bound is asyncio's (the timeout plus the loop's lag), which also closes a
        # connection it cuts short (redis-py disconnects on a cancelled read); no socket timeout
        # besides: its timer around every reply cost a decision ~40 µs of CPU
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.url, max_connections=MAX_CONNECTIONS, timeout=None, password=password,
            socket_timeout=None, socket_connect_timeout=10 * self.timeout,
        )  # fmt: skip
        self.client = aioredis.Redis.from_pool(pool)
        self.lost = asyncio.Event()
        self.closing = False  # the router leaves: every loop ends
        self._lag = 0.0  # the event loop's recent lag, seconds (a decaying maximum)

    @property
    def in_use(self) -> bool:
        return self.metrics.store_in_use

    async def connect(self, first_read: Callable[[aioredis.Redis], Awaitable[T]]) -> T | None:
        """(Re)connect, ``first_read`` the first call: its reply, or None when the store does not
        answer (the router stays on its own state)."""
        await self.client.connection_pool.disconnect()  # connections to a store that went away are dead
        try:
            async with asyncio.timeout(self.budget()):
                reply = await first_read(self.client)
        except FAILURES as exc:
            self.failed("connect", exc)
            return None
        self.lost.clear()
        self.metrics.store_in_use = True
        log.info("store_in_use", url=_without_password(self.settings.url), router=self.router_id)
        return reply

    async def watch_lag(self) -> None:
        """How late the event loop runs what is due: a call that took long on a busy loop may have
        been answered in time, so each call's bound is the timeout plus this."""
        loop = asyncio.get_running_loop()
        while not self.closing:
            due = loop.time() + LAG_EVERY_S
            await asyncio.sleep(LAG_EVERY_S)
            self._lag = max(loop.time() - due, self._lag * LAG_DECAY)

    def budget(self) -> float:
        return self.timeout + min(self._lag, 2 * self.timeout)

    def failed(self, call: str, exc: BaseException) -> None:
        """A call failed: a slow or refused one costs only itself; a lost link puts the router on
        its own state until a reconnection."""
        self.metrics.store_errors[call] += 1
        if not _link_lost(exc) and call != "connect":
            return
        if self.metrics.store_in_use or (call == "connect" and self.metrics.store_errors[call] == 1):
            log.warning("store_unavailable", call=call, error=type(exc).__name__, detail=str(exc)[:200],
                        retry_every_s=self.settings.retry_seconds)
        self.metrics.store_in_use = False
        self.lost.set()


def _link_lost(exc: BaseException) -> bool:
    """The connection is gone (refused, reset, closed, auth refused); not a slow call, which
    costs only itself."""
    if isinstance(exc, ConnectionRefusedError | ConnectionResetError | BrokenPipeError):
        return True
    return isinstance(exc, LinkError) and not isinstance(exc, TimeoutError)


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if "@" in rest else url
