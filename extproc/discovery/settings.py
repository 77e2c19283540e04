"""The [discovery] settings: the source, the keys every source shares, and each source's own
section ``[discovery.<name>]`` validated by the source's model (extproc/discovery/plugin.py).

The service's other sections, the file and the environment overrides are in extproc/settings.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, Field, ValidationError, model_validator

from extproc.discovery import plugin
from extproc.strict import Strict, validated_sections


class DiscoverySettings(Strict):
    """Where the replica list comes from. The section of ``source`` must be given; any other given
    is checked too (the reference file holds them all: switching ``source`` alone works)."""

    source: str = Field(description="where the replica list comes from: a registered source "
                                    "(extproc/discovery/plugin.py), configured by [discovery.<source>]")
    leaving_seconds: float = Field(ge=0, le=3600, description="a terminating replica that still serves (a "
                                   "source that reports one: kubernetes, inference-pool) stays listed this long "
                                   "in the order of leaving; 0: it leaves the list at once")
    leaving_near_seconds: float = Field(ge=0, description="this long before leaving_seconds, follow-ups of its "
                                                          "unmoved conversations go elsewhere")
    sections: dict[str, Any] = Field(description="source name -> its validated section (built from the sections)")

    @model_validator(mode="before")
    @classmethod
    def _source_sections(cls, raw: Any) -> Any:
        """Each section named by a registered source becomes its validated model under ``sections``."""
        if not isinstance(raw, Mapping) or "sections" in raw:
            return raw
        chosen = raw.get("source")
        if chosen is not None and chosen not in plugin.REGISTRY:
            names = [repr(name) for name in plugin.REGISTRY]
            expected = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
            raise ValidationError.from_exception_data("DiscoverySettings", [
                {"type": "literal_error", "loc": ("source",), "input": chosen, "ctx": {"expected": expected}}])
        sections = validated_sections(raw, plugin.REGISTRY, chosen,
                                      lambda name, section: plugin.plugin(name).settings.model_validate(section),
                                      "DiscoverySettings")
        shared = {key: value for key, value in raw.items() if key not in plugin.REGISTRY}
        return {**shared, "sections": sections}

    @classmethod
    def named_sections(cls) -> dict[str, type[BaseModel]]:
        """[discovery.<name>] -> its model, for every registered source (an error names their keys)."""
        return {name: plugin.plugin(name).settings for name in plugin.REGISTRY}

    @property
    def section(self) -> Any:
        """The chosen source's section."""
        return self.sections[self.source]
