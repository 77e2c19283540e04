"""The local stack's settings: stack.toml's schema, loading it, the run dir, the slot check."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from extproc.migration.settings import MigrationSection
from extproc.settings import read_toml, validate_settings
from extproc.stack import models, replicas
from extproc.stack.errors import StackError
from extproc.stack.ports import PortsSection
from extproc.stack.replicas import ReplicaSettings
from extproc.strict import Strict

REFERENCE_SETTINGS = Path(__file__).with_name("stack.toml")
RUN_ENV = "LLM_RING_RUN"


class ReplicasSection(Strict):
    count: int = Field(ge=1, le=64)
    backend: replicas.Backend
    llama_server: str
    # one model for every replica, or the models the replicas serve in turn (llm-i: the (i mod n)-th)
    model: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]]
    ctx_size: int = Field(gt=0)
    parallel: int = Field(gt=0)
    threads: int = Field(gt=0)
    batch_size: int = Field(gt=0)
    ubatch_size: int = Field(gt=0)
    cache_ram_mib: int = Field(ge=0)
    slot_prompt_similarity: float = Field(ge=0, le=1)
    models_max: int = Field(ge=0, le=64)
    sleep_idle_seconds: int = Field(ge=0)
    lora: list[Annotated[str, Field(min_length=1)]]  # LoRA adapters every replica loads, in order
    health_timeout_seconds: float = Field(gt=0)

    @model_validator(mode="after")
    def _router_mode_backend(self) -> ReplicasSection:
        if self.models_max and self.backend != "llama-server":
            raise ValueError("models_max: router mode needs backend = \"llama-server\" (xllamacpp has none; "
                             "build it: llm-ring models build-llama-server)")
        return self

    @field_validator("model")
    @classmethod
    def _some_model(cls, model: str | list[str]) -> str | list[str]:
        if isinstance(model, list) and not model:
            raise ValueError("names no model: give one, or a list of the models the replicas serve in turn")
        return model

    @property
    def models(self) -> tuple[str, ...]:
        """The models the replicas serve in turn: replica llm-i serves models[i mod len(models)]."""
        return (self.model,) if isinstance(self.model, str) else tuple(self.model)


class GatewaysSection(Strict):
    count: int = Field(ge=1, le=16)
    redis_server: str


class RouterSection(Strict):
    policy: str
    settings: str


class CheckSection(Strict):
    profile: str


class StackSettings(Strict):
    replicas: ReplicasSection
    gateways: GatewaysSection
    ports: PortsSection
    router: RouterSection
    check: CheckSection
    migration: MigrationSection


def load_stack_settings(path: str | Path | None = None,
                        overrides: Mapping[str, Mapping[str, Any]] | None = None) -> StackSettings:
    """stack.toml (or `path`) with `overrides` ({section: {key: value}}, None values ignored);
    SettingsError naming the file and the key."""
    source = Path(path) if path else REFERENCE_SETTINGS
    raw = read_toml(source)
    for section, values in (overrides or {}).items():
        raw.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    return validate_settings(StackSettings, raw, str(source))


def run_dir(explicit: str | Path | None = None, data: Path | None = None) -> Path:
    """--run-dir, else $LLM_RING_RUN, else <data dir>/run."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get(RUN_ENV):
        return Path(os.environ[RUN_ENV]).expanduser()
    return (data or models.data_dir()) / "run"


def check_slot_context(profile_name: str, settings: ReplicaSettings) -> None:
    """The profile's conversations must fit in one slot (ctx_size / parallel), with a margin."""
    from extproc.traffic.profile import ProfileError, check_context, load_profile

    try:
        check_context(load_profile(profile_name), settings.slot_context)
    except ProfileError as exc:
        raise StackError(f"[check] profile: {exc}") from None
