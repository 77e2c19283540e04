"""The data planes: the ways Envoy reaches the service over ext_proc, one module per mode.

- own_envoy.py: the Envoy llm-ring renders (own_envoy_config.py, with its routes and clusters in
  own_envoy_routes.py and own_envoy_clusters.py): route and observe streams with CEL
  attributes, and the access log that ends each request;
- picker.py: a Gateway API Inference Extension gateway's Endpoint Picker stream, which
  carries a whole request and whose end ends it (picker_gateways.py renders the gateways the
  tests and the bench run).

Each mode is a ``DataPlane`` (plane.py): it recognises its streams' first message, reads the
request, answers it in its own ``AnswerShape`` and learns its end. A stream goes to the first
mode that claims it, the last registered asked first: the Endpoint Picker's, which takes any
request, is registered first. A new mode is a module (its Envoy's renderer beside it) and one
``register`` line.
"""

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
