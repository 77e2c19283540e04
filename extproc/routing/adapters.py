"""A request's LoRA adapters as part of where its cache lives (pure, no I/O).

llama.cpp's server takes per-request adapters, ``"lora": [{"id": N, "scale": S}, ...]``, over
the adapters it loaded at start (``--lora FILE``, numbered from 0 in order). A slot's KV cache
computed under one adapter configuration is dropped when a request of another takes the slot,
and requests of different configurations are not batched together. A request's configuration
as llama.cpp compares it (tools/server: ``parse_lora_request``, ``construct_lora_list``,
``are_lora_equal``): every loaded adapter gets the scale the request names for its id, or 0;
the last entry of an id wins; scales are compared as 32-bit floats. So an entry of scale 0 is
no entry, and the order of the entries does not matter. A body without ``lora``, or with an
empty list, runs under the server's own configuration (the adapters as loaded: applied at 1.0,
or not at all with ``--lora-init-without-apply``, as the local stack starts them).

``label`` names a configuration in one string ("" for the server's own): the cache ``scope``
of a request is its model with that label, and it stands where the model stood in the
conversation's key (continuation.of_model), in the prefix blocks' seed (blocks.model_seed) and in
a completed request's branch point (continuation.model_point). Which replicas may serve a
request is still decided by its model alone: every replica of a model loads the same adapters.

llama.cpp does not batch requests of different configurations: a step serves the first busy
slot's configuration and the slots it can batch with, so a request arriving beside another
configuration's decoding waits for it to finish (SmolLM2, 2 slots, 1 thread: first token after
1,792 ms instead of 377 ms, 0.6 s into a 96-token answer). ``InFlight`` keeps the configurations
of the requests in flight on each replica; llm-aware's prediction of the first token
(``predicted_ttft``) sees a replica running another configuration as having no free slot
(``seen_running``): the request waits behind all of its work.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

from extproc.routing.continuation import SEPARATOR

Adapters = tuple[tuple[int, float], ...]  # (id, scale), sorted by id, no scale 0
PREFIX = "lora:"
NONE_APPLIED = "none"  # a list whose every scale is 0: no adapter applied


def normalised(entries: Iterable[tuple[int, float]]) -> Adapters:
    """The configuration llama.cpp applies for ``entries`` (in body order): the last scale of
    each id, as a 32-bit float, scale 0 dropped, sorted by id. OverflowError: a scale beyond
    a 32-bit float's range."""
    scales = {adapter: as_float32(scale) for adapter, scale in entries}
    return tuple(sorted((adapter, scale) for adapter, scale in scales.items() if scale != 0.0))


def as_float32(value: float) -> float:
    """``value`` as llama.cpp holds a scale (a C float): equal scales stay equal here."""
    (rounded,) = struct.unpack("<f", struct.pack("<f", value))
    return float(rounded)


def label(adapters: Adapters | None) -> str:
    """A configuration's name: "" for None (the server's own), else ``lora:`` with ``id=scale``
    pairs (``lora:none`` when no adapter is applied)."""
    if adapters is None:
        return ""
    return PREFIX + (",".join(f"{adapter}={scale!r}" for adapter, scale in adapters) or NONE_APPLIED)


def scope(model: str, adapters_label: str) -> str:
    """Where a request's cache lives: its model, under the adapter configuration ``adapters_label``
    names (the model alone for the server's own configuration)."""
    return f"{model}{SEPARATOR}{adapters_label}" if adapters_label else model


def seen_running(running: Mapping[str, int], slots: int, unbatched: frozenset[str]) -> Mapping[str, int]:
    """The requests in flight per replica as a prediction of the first token sees them: ``slots``
    (none free) on the replicas in ``unbatched``, where the request would wait for another
    configuration's requests to finish; ``running`` itself when there is none."""
    if not unbatched:
        return running
    return {name: slots if name in unbatched else count for name, count in running.items()}


class InFlight:
    """The adapter configurations of the requests in flight on each replica, per model."""

    __slots__ = ("_on",)

    def __init__(self) -> None:
        self._on: dict[tuple[str, str], dict[str, int]] = {}  # (model, label) -> {replica: requests}

    def sent(self, model: str, adapters_label: str, replica: str) -> None:
        on = self._on.setdefault((model, adapters_label), {})
        on[replica] = on.get(replica, 0) + 1

    def ended(self, model: str, adapters_label: str, replica: str) -> None:
        on = self._on.get((model, adapters_label))
        if on is None or replica not in on:
            return
        on[replica] -= 1
        if not on[replica]:
            del on[replica]
            if not on:
                del self._on[(model, adapters_label)]

    def unbatched(self, model: str, adapters_label: str) -> frozenset[str]:
        """The replicas running a request of ``model`` under another configuration than ``adapters_label``."""
        return frozenset(replica for (named, other), on in self._on.items()
                         if named == model and other != adapters_label for replica in on)
