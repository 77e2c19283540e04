"""Replicas from a JSON file {name: "ip:port"}, polled for changes (the local stack writes it).

The writer replaces the file atomically (tmp + rename), so a read sees the old or the new
list, never half of one. A missing file means no replicas yet; a malformed one is logged and
the last good list kept, so a bad edit never empties the ring.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import structlog
from pydantic import Field

from extproc.discovery import ReplicaListError, checked_replicas
from extproc.discovery.plugin import SharedKeys, SourcePlugin
from extproc.strict import Strict

log = structlog.get_logger("extproc.discovery.file")


class FileSettings(Strict):
    """[discovery.file]"""

    path: str = Field(description='JSON file {name: "ip:port"}, replaced atomically by its writer')
    poll_seconds: float = Field(gt=0, description="how often the file is checked for changes")


class FileDiscovery:
    def __init__(self, path: str | Path, poll_seconds: float) -> None:
        self.path = Path(path)
        self.poll_seconds = poll_seconds

    async def snapshots(self) -> AsyncIterator[dict[str, str]]:
        current: dict[str, str] | None = None
        stamp: tuple[int, int, int] | None = None
        while True:
            new_stamp = self._stamp()
            if new_stamp != stamp or current is None:
                stamp = new_stamp
                replicas = self._read(current)
                if replicas != current:
                    current = replicas
                    yield dict(replicas)
            await asyncio.sleep(self.poll_seconds)

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _read(self, last_good: dict[str, str] | None) -> dict[str, str]:
        try:
            return checked_replicas(json.loads(self.path.read_text()), str(self.path))
        except FileNotFoundError:
            return {}
        except (ValueError, ReplicaListError) as exc:  # JSONDecodeError is a ValueError
            log.error("replica_file_invalid", path=str(self.path), error=str(exc))
            return last_good if last_good is not None else {}


def _from_settings(section: FileSettings, shared: SharedKeys) -> FileDiscovery:
    return FileDiscovery(section.path, section.poll_seconds)


PLUGIN = SourcePlugin("file", FileSettings, _from_settings)
