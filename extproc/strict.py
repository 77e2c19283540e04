"""The base of every settings section: unknown keys are refused by name, values are frozen."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


def validated_sections(raw: Mapping[str, Any], names: Iterable[str], chosen: str | None,
                       validate: Callable[[str, Any], Any], model: str) -> dict[str, Any]:
    """The named sections given in ``raw`` (and the ``chosen`` one, given or not: its keys are then
    missing), each validated by ``validate(name, section)``; every problem raised at once, each
    located under its section (``llm-aware.ttft_margin``), as the ValidationError of ``model``."""
    sections, problems = {}, []
    for name in names:
        if name in raw or name == chosen:
            try:
                sections[name] = validate(name, raw.get(name, {}))
            except ValidationError as exc:
                problems += [{"type": error["type"], "loc": (name, *error["loc"]), "input": error["input"],
                              **({"ctx": error["ctx"]} if "ctx" in error else {})} for error in exc.errors()]
    if problems:
        raise ValidationError.from_exception_data(model, problems)  # type: ignore[arg-type]
    return sections
