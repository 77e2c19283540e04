"""The base of every settings section: unknown keys are refused by name, values are frozen."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)
