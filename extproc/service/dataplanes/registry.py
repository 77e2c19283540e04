"""Which data plane (a module of this package) serves an ext_proc stream: the registered modes,
the last registered asked first."""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.service.dataplanes import own_envoy, picker
from extproc.service.dataplanes.plane import DataPlane

PLANES: list[DataPlane] = []


def register(plane: DataPlane) -> None:
    """A mode, asked before those registered earlier."""
    if any(known.name == plane.name for known in PLANES):
        raise ValueError(f"data plane {plane.name!r} is registered already")
    PLANES.insert(0, plane)


def unregister(name: str) -> None:
    PLANES[:] = [plane for plane in PLANES if plane.name != name]


def choose(first: pb.ProcessingRequest, own_envoy: bool) -> tuple[DataPlane, str] | None:
    """The mode serving the stream ``first`` opens, and the stream's name; None: no mode's (left unanswered)."""
    for plane in PLANES:
        stream = plane.claims(first, own_envoy)
        if stream:
            return plane, stream
    return None


register(picker.PLANE)
register(own_envoy.PLANE)
