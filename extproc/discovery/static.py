"""A fixed replica list from the settings file (``[discovery.static] replicas``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

from pydantic import Field

from extproc.discovery import checked_replicas
from extproc.discovery.plugin import SharedKeys, SourcePlugin
from extproc.strict import Strict


class StaticSettings(Strict):
    """[discovery.static]"""

    replicas: dict[str, str] = Field(description='replica name -> "ip:port"')


class StaticDiscovery:
    def __init__(self, replicas: Mapping[str, str]) -> None:
        self.replicas = checked_replicas(replicas, "discovery.static.replicas")

    async def snapshots(self) -> AsyncIterator[dict[str, str]]:
        yield dict(self.replicas)
        await asyncio.Event().wait()  # a static list never changes; the consumer cancels us


def _from_settings(section: StaticSettings, shared: SharedKeys) -> StaticDiscovery:
    return StaticDiscovery(section.replicas)


PLUGIN = SourcePlugin("static", StaticSettings, _from_settings)
