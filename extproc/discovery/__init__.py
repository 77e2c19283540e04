"""Where the replica list comes from: a static list, a watched JSON file, or Kubernetes
(a Service's EndpointSlices, or an InferencePool's pods); each source is a module named in
the registry (plugin.py), configured by its own section ``[discovery.<source>]``.

Every source speaks one protocol: ``snapshots()`` is an async iterator yielding the full
current set {replica name: "ip:port"} each time it changes (the first yield is the initial
set, possibly empty). The service feeds each snapshot to ``Gateway.set_replicas``. The
Kubernetes sources yield a ``Snapshot``, which also names the replicas on their way out: a
terminating pod that still serves, kept in the list for the order of leaving
(extproc/routing/leaving.py) until it stops serving.
"""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any, Protocol


class Snapshot(dict[str, str]):
    """{replica name: "ip:port"}; ``leaving``: those of them that are terminating but still serve.
    Equal to another snapshot (or a plain dict, whose ``leaving`` is empty) only with the same
    leaving replicas."""

    def __init__(self, replicas: Mapping[str, str] | None = None, leaving: Iterable[str] = ()) -> None:
        super().__init__(replicas or {})
        self.leaving = frozenset(leaving) & self.keys()

    def __eq__(self, other: object) -> bool:
        return dict.__eq__(self, other) is True and self.leaving == getattr(other, "leaving", frozenset())

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __repr__(self) -> str:
        if not self.leaving:
            return dict.__repr__(self)
        return f"Snapshot({dict.__repr__(self)}, leaving={sorted(self.leaving)})"

    __hash__ = None  # type: ignore[assignment]  # a dict: unhashable


def leaving_of(replicas: Mapping[str, str]) -> frozenset[str]:
    """The replicas of a snapshot on their way out (none for a plain mapping)."""
    return replicas.leaving if isinstance(replicas, Snapshot) else frozenset()


class Discovery(Protocol):
    def snapshots(self) -> AsyncIterator[dict[str, str]]: ...


class ReplicaListError(ValueError):
    """A replica list is malformed; the message names the source and the entry."""


def checked_replicas(raw: Any, source: str) -> dict[str, str]:
    if not isinstance(raw, Mapping):
        raise ReplicaListError(f'{source}: expected an object {{name: "ip:port"}}, got {type(raw).__name__}')
    replicas: dict[str, str] = {}
    for name, address in raw.items():
        if not isinstance(name, str) or not name:
            raise ReplicaListError(f"{source}: replica names must be non-empty strings, got {name!r}")
        if not isinstance(address, str) or not _is_ip_port(address):
            raise ReplicaListError(f'{source}: {name}: expected "ip:port", got {address!r}')
        replicas[name] = address
    return replicas


def _is_ip_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return False
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True
