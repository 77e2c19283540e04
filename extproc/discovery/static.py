"""A fixed replica list from the settings file (``discovery.static``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

from extproc.discovery import checked_replicas
from extproc.settings import DiscoverySettings


class StaticDiscovery:
    def __init__(self, replicas: Mapping[str, str]) -> None:
        self.replicas = checked_replicas(replicas, "discovery.static")

    async def snapshots(self) -> AsyncIterator[dict[str, str]]:
        yield dict(self.replicas)
        await asyncio.Event().wait()  # a static list never changes; the consumer cancels us


def from_settings(settings: DiscoverySettings) -> StaticDiscovery:
    return StaticDiscovery(settings.static)
