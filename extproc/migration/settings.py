"""Settings of a migration: [migration] (the local stack's stack.toml and the Kubernetes slot
sidecar's slots.toml, the same keys) and [sidecar] (the slot sidecar of a Kubernetes replica,
k8s/15-slot-sidecar-config.yaml). No defaults: a missing key stops start-up naming it. A
``LLM_RING__<SECTION>__<KEY>`` variable overrides a key, as for the router (one model's replicas
of a fleet of several: their kv_bytes_per_token, k8s/two-models/)."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path

from pydantic import Field, ValidationError

from extproc.settings import SettingsError, apply_env_overrides, describe_errors
from extproc.strict import Strict


class MigrationSection(Strict):
    enabled: bool
    drain_seconds: float = Field(gt=0)
    # this long before drain_seconds, unmoved conversations' follow-ups stop going to the leaving replica
    near_seconds: float = Field(default=15.0, ge=0)
    min_tokens: int = Field(ge=0)
    max_disk_mib: int = Field(gt=0)
    max_age_seconds: float = Field(gt=0)
    prefill_ms_per_token: float = Field(gt=0)
    transfer_mib_per_second: float = Field(gt=0)


class SidecarSection(Strict):
    listen: str = Field(pattern=r"^[^:]*:[0-9]+$", description="host:port the sidecar serves on (its pod's address)")
    folder: Path = Field(description="the slot volume, llama-server's --slot-save-path")
    model_folder: Path = Field(description="where the replica's model file (MODEL_FILE) is")
    kv_bytes_per_token: int = Field(gt=0, description="a slot file's bytes per token (layers x KV heads x "
                                                      "(key + value width) x 2 at f16)")
    namespace: str = Field(min_length=1)
    replicas_service: str = Field(min_length=1, description="the replicas' headless Service (its EndpointSlices)")
    replica_port_name: str = Field(min_length=1, description="its port of llama-server")
    sidecar_port_name: str = Field(min_length=1, description="its port of the slot sidecars")
    routers_service: str = Field(min_length=1, description="the Service of every router's migration port")
    routers_port_name: str = Field(min_length=1)
    router_token_file: str = Field(description="file holding the token the routers' migration ports want "
                                               "(their service.migration_token_file's); empty: none")
    replica_api_key_file: str = Field(description="file holding the API key every replica wants (their "
                                                  "--api-key-file), for this pod's llama-server and the "
                                                  "receivers'; empty: none")
    settle_seconds: float = Field(ge=0, le=60, description="after this pod's endpoint turns terminating: the "
                                                            "routers' watches see it, the last requests arrive")


class SlotSidecarSettings(Strict):
    migration: MigrationSection
    sidecar: SidecarSection


def load_sidecar_settings(path: Path, environ: Mapping[str, str]) -> SlotSidecarSettings:
    try:
        raw = tomllib.loads(path.read_text())
        apply_env_overrides(raw, environ)
    except FileNotFoundError:
        raise SettingsError(f"settings file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: not valid TOML: {exc}") from None
    try:
        return SlotSidecarSettings.model_validate(raw)
    except ValidationError as exc:
        raise SettingsError(describe_errors(exc, str(path))) from None
