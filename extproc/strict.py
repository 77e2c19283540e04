"""The base of every settings section: unknown keys are refused by name, values are frozen."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


def errors_within(section: str, exc: ValidationError) -> list[Any]:
    """The errors of a nested section's validation, each located under ``section``, ready for
    ``ValidationError.from_exception_data`` (so that the message names ``section.key``)."""
    return [{"type": error["type"], "loc": (section, *error["loc"]), "input": error["input"],
             **({"ctx": error["ctx"]} if "ctx" in error else {})} for error in exc.errors()]
