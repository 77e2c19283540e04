"""Brings failed replicas back: probes GET /health until it answers 200.

A replica is marked unhealthy when a request routed there failed over to a fallback (or
failed to connect); the router avoids it meanwhile. Discovery removing it ends its probe.
"""

from __future__ import annotations

import asyncio

import structlog

from extproc.envoy.contract import split_host_port
from extproc.service.gateway import Gateway

log = structlog.get_logger("extproc.service.health")


class ReplicaHealth:
    def __init__(self, gateway: Gateway, interval_seconds: float, timeout_seconds: float = 2.0) -> None:
        self.gateway = gateway
        self.interval = interval_seconds
        self.timeout = timeout_seconds
        self._probes: dict[str, asyncio.Task[None]] = {}

    def replica_failed(self, name: str) -> None:
        log.warning("replica_unhealthy", replica=name, endpoint=self.gateway.fleet.endpoints.get(name))
        if name not in self._probes or self._probes[name].done():
            self._probes[name] = asyncio.get_running_loop().create_task(self._probe(name))

    async def _probe(self, name: str) -> None:
        while name in self.gateway.fleet.unhealthy:
            await asyncio.sleep(self.interval)
            endpoint = self.gateway.fleet.endpoints.get(name)
            if endpoint is None:
                return
            if await self.healthy(endpoint):
                self.gateway.mark_healthy(name)
                log.info("replica_healthy", replica=name, endpoint=endpoint)
                return

    async def healthy(self, endpoint: str) -> bool:
        host, port = split_host_port(endpoint)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), self.timeout)
        except (OSError, TimeoutError):
            return False
        try:
            writer.write(f"GET /health HTTP/1.1\r\nhost: {endpoint}\r\nconnection: close\r\n\r\n".encode())
            status_line = await asyncio.wait_for(reader.readline(), self.timeout)
            return status_line.split(b" ")[1:2] == [b"200"]
        except (OSError, TimeoutError):
            return False
        finally:
            writer.close()

    def close(self) -> None:
        for task in self._probes.values():
            task.cancel()
