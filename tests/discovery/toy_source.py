"""toy: a discovery source made outside extproc, to show what one is: this module and one
``register`` line.

Its section ``[discovery.toy]`` lists waves of replica names; it yields them one after the other,
each replica on 127.0.0.1 at ``first_port`` plus its number, then keeps the last.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pydantic import Field

from extproc.discovery.plugin import SharedKeys, SourcePlugin
from extproc.strict import Strict


class ToySettings(Strict):
    """[discovery.toy]"""

    waves: list[list[str]] = Field(min_length=1, description="the replica sets yielded, in order")
    first_port: int = Field(gt=0, lt=65000, description="the port of the first replica named")


class ToyDiscovery:
    def __init__(self, section: ToySettings) -> None:
        self.section = section

    async def snapshots(self) -> AsyncIterator[dict[str, str]]:
        names = sorted({name for wave in self.section.waves for name in wave})
        ports = {name: self.section.first_port + number for number, name in enumerate(names)}
        for wave in self.section.waves:
            yield {name: f"127.0.0.1:{ports[name]}" for name in wave}
        await asyncio.Event().wait()  # the last wave stays; the consumer cancels us


def _from_settings(section: ToySettings, shared: SharedKeys) -> ToyDiscovery:
    return ToyDiscovery(section)


PLUGIN = SourcePlugin("toy", ToySettings, _from_settings)
