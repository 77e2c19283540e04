"""Every setting of the routing service, typed, in one place.

Settings come from one TOML file, overridden by environment variables named
``LLM_RING__<SECTION>__<KEY>`` (values parsed as TOML scalars, so ``0.3``, ``true``
and ``"x"`` keep their types). There are no defaults here on purpose: a missing key
stops start-up with its dotted name, so what runs is exactly what the file says.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

import tomli_w
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, model_validator

from extproc.cli_input import UsageError
from extproc.discovery.settings import DiscoverySettings
from extproc.routing.flows import FlowSettings
from extproc.routing.settings import MOVED_KEYS, RoutingSettings
from extproc.strict import Strict

ENV_PREFIX = "LLM_RING__"
SectionsT = TypeVar("SectionsT", bound=BaseModel)

# where a session id is read ([service] session_ids, service/sessions.py): an HTTP header name as
# HTTP/2 and Envoy carry it (lowercase token characters), or a top-level JSON field
SESSION_SOURCE = r"^(header:[a-z0-9!#$%&'*+.^_`|~-]{1,64}|body:[A-Za-z_][A-Za-z0-9_]{0,63})$"


class ServiceSettings(Strict):
    """The ext_proc gRPC service (the shell around the core)."""

    listen: str = Field(description="host:port of the picker port: ext_proc as an Endpoint Picker + health, what an "
                                    "InferencePool gateway reaches (empty: none)")
    ext_proc_socket: str = Field(
        pattern=r"^[A-Za-z0-9._-]{0,100}$",
        description="abstract unix socket name of our own Envoy, in this pod or on this host: ext_proc and the "
                    "access log service, served nowhere else (empty: neither, as behind an InferencePool gateway)",
    )
    tls: str = Field(description='the picker port over TLS: "" plaintext, "self-signed" (a certificate made '
                                 'at start-up) or a folder holding tls.crt and tls.key (a mounted kubernetes.io/tls '
                                 'Secret)')
    admin_listen: str = Field(min_length=1, description="host:port of the Admin API + health (plaintext; never the "
                                                        "picker port: keep it on loopback or a pod-local address)")
    migration_listen: str = Field(description="host:port of the migration port: only the Admin API's GetState, "
                                              "Placements and Migrated, what a leaving replica's slot sidecar "
                                              "calls (empty: none; Kubernetes: the pod's address, fenced by "
                                              "NetworkPolicy and migration_token_file)")
    migration_token_file: str = Field(description="file holding the bearer token every call to the migration "
                                                  "port must carry; required unless migration_listen is on "
                                                  "loopback (empty: no token)")
    replica_api_key_file: str = Field(description="file holding the API key the replicas want (their "
                                                  "--api-key-file), set on every generation routed "
                                                  "(empty: none; our own Envoy adds it itself)")
    metrics_listen: str = Field(min_length=1, description="host:port of the Prometheus /metrics endpoint")
    tokenizer: str = Field(min_length=1, description='how prompt tokens are counted: "chars" (characters / '
                                                     'chars_per_token) or the path of the model\'s GGUF file '
                                                     '(its tokenizer and chat template, as the replica counts)')
    chars_per_token: float = Field(gt=0, description='prompt tokens = characters / chars_per_token (tokenizer = '
                                                     '"chars")')
    max_body_bytes: int = Field(gt=0, description="larger request bodies are refused with 413")
    default_max_tokens: int = Field(gt=0, description="output tokens charged when a request names none")
    max_output_tokens: int = Field(
        gt=0, description="one slot's context: a larger max_tokens / n_predict, or -1, is charged as this many"
    )
    max_messages: int = Field(gt=0, description="chat requests with more messages are refused (413)")
    max_prompt_chars: int = Field(gt=0, description="prompts with more characters (or token ids) are refused (413)")
    log_level: Literal["debug", "info", "warning", "error"]
    fallbacks: int = Field(ge=0, le=8, description="endpoints after the pick, tried by Envoy on connect failure")
    health_probe_seconds: float = Field(gt=0, description="probe period (GET /health) of a replica that failed")
    model_status_seconds: float = Field(gt=0, description="how often each replica's loaded models and sleep are "
                                                          "read again (docs/fleets.md)")
    observe_grace_ms: int = Field(ge=0, le=10_000, description="SSE: wait after the access log entry for the end")
    envoy_endpoints_file: str = Field(description="EDS file written for Envoy; empty: Envoy resolves DNS")
    fail_open: bool = Field(description="Envoy: round robin when this service is down (true) or 500 (false)")
    drain_seconds: float = Field(ge=0, le=3600, description="SIGTERM: in-flight requests get this long to finish")
    routing_headers: bool = Field(description="answers carry x-routed-to, x-route-reason and "
                                              "x-route-predicted-cached-tokens (a debugging aid)")
    shed_requests_per_replica: int = Field(ge=0, description="429 when every eligible replica has this many requests "
                                                             "in flight (0: never shed)")
    session_ids: list[Annotated[str, Field(pattern=SESSION_SOURCE)]] = Field(
        description='where a request\'s conversation id is read from, the first one it carries: '
                    '"header:NAME" (a request header) or "body:FIELD" (a top-level string of its JSON body); '
                    'none carried: the conversation\'s opening')
    cors_origins: list[Annotated[str, Field(pattern=r"^(\*|https?://[^\s/,]+)$")]] = Field(
        description='origins a browser may call the gateway from ("https://chat.example.com", or "*" for any); '
                    'empty: no CORS headers, preflights refused')

    @model_validator(mode="after")
    def _reachable(self) -> ServiceSettings:
        if not self.listen and not self.ext_proc_socket:
            raise ValueError("listen and ext_proc_socket are both empty: the gateway could not reach the service")
        if self.listen and self.listen == self.admin_listen:
            raise ValueError("admin_listen must differ from listen: the gateway must not reach the Admin API")
        if self.migration_listen and self.migration_listen in (self.listen, self.admin_listen):
            raise ValueError("migration_listen must differ from listen and admin_listen: it serves only what a "
                             "migration needs")
        return self

    @field_validator("session_ids")
    @classmethod
    def _each_once(cls, sources: list[str]) -> list[str]:
        repeated = sorted({source for source in sources if sources.count(source) > 1})
        if repeated:
            raise ValueError(f"listed more than once: {', '.join(repeated)}")
        return sources

    @field_validator("migration_token_file")
    @classmethod
    def _token_off_loopback(cls, path: str, info: ValidationInfo) -> str:
        """Beyond loopback, a token is all that stands between the pod network and the port."""
        listen = info.data.get("migration_listen", "")
        if listen and not path and not _on_loopback(listen):
            raise ValueError(f"required: migration_listen {listen!r} is not on loopback")
        return path


def _on_loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name (or no host, "all addresses"): reachable from elsewhere
        return False


class StoreSettings(Strict):
    """The state several routers share (docs/several-gateways.md): off when ``url`` is empty."""

    url: str = Field(pattern=r"^$|^(redis|rediss|unix)://",
                     description="Redis URL of the shared store; empty: this router's own state only")
    password_file: str = Field(description="file holding the store's password; empty: none")
    key_prefix: str = Field(pattern=r"^[A-Za-z0-9._-]{1,64}$", description="prefix of every key this router writes")
    # well under Envoy's ext_proc message timeout (extproc/service/dataplanes/own_envoy_config.py, 2 s),
    # which fails open
    timeout_ms: int = Field(gt=0, le=500, description="a store read taking longer costs that decision the shared view")
    retry_seconds: float = Field(gt=0, le=3600, description="a lost connection is tried again this often")
    load_ttl_seconds: float = Field(gt=0, le=600, description="a router's published load expires after this "
                                                               "without a heartbeat (every third of it)")
    placement_ttl_seconds: int = Field(gt=0, description="a conversation's shared placement is forgotten "
                                                         "after this long without a turn")
    first_placement_ttl_seconds: int = Field(gt=0, description="a conversation's first placement (one that "
                                                               "never came back) is forgotten after this long")
    max_peer_requests: int = Field(gt=0, description="most requests one router has in flight on one replica: "
                                                     "a published load above it is skipped")

    @field_validator("url")
    @classmethod
    def _a_usable_url(cls, url: str) -> str:
        """Refused here, by key, rather than by the client at start-up."""
        if url:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError for a port that is no number or out of range
            if parts.scheme != "unix" and not parts.hostname:
                raise ValueError("a redis:// URL names a host, e.g. redis://127.0.0.1:6379/0")
            if parts.scheme == "unix" and not parts.path:
                raise ValueError("a unix:// URL names the socket's path, e.g. unix:///run/redis.sock")
        return url


class Settings(Strict):
    routing: RoutingSettings
    service: ServiceSettings
    discovery: DiscoverySettings
    store: StoreSettings
    flow: FlowSettings

    @field_validator("flow")
    @classmethod
    def _one_flow_control(cls, flow: FlowSettings, info: ValidationInfo) -> FlowSettings:
        """One way of holding back load at a time."""
        service = info.data.get("service")
        if flow.enabled and service is not None and service.shed_requests_per_replica:
            raise ValueError("enabled: service.shed_requests_per_replica must be 0 with flow control (the queue "
                             "replaces shedding)")
        routing = info.data.get("routing")
        if routing is not None and flow.reserved_slots >= routing.replicas.slots:
            raise ValueError(f"reserved_slots ({flow.reserved_slots}) must be below routing.replicas.slots "
                             f"({routing.replicas.slots}): a replica would take nothing")
        return flow


class SettingsError(UsageError):
    """A setting is missing or invalid; the message names the dotted key and where it came from."""


def read_secret_file(key: str, path: str) -> str | None:
    """The secret in the file a ``*_file`` setting names (None when it names none), read at
    start-up; SettingsError naming the key when that file cannot be read or holds nothing."""
    if not path:
        return None
    try:
        secret = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"{key}: cannot read {path} ({type(exc).__name__})") from None
    if not secret:
        raise SettingsError(f"{key}: {path} is empty")
    return secret


def load_settings(path: str | Path, environ: Mapping[str, str] | None = None) -> Settings:
    raw = read_toml(path)
    from_env = apply_env_overrides(raw, os.environ if environ is None else environ)
    return parse_settings(raw, source=str(path), from_env=from_env)


def read_toml(path: str | Path) -> dict[str, Any]:
    """A settings file's tables; SettingsError naming the file if it cannot be read or is no TOML."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsError(f"settings file not found: {path}") from None
    except OSError as exc:
        raise SettingsError(f"{path}: cannot be read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: not valid TOML: {exc}") from None


def validate_settings(model: type[SectionsT], raw: Mapping[str, Any], source: str,
                      from_env: Mapping[tuple[str, ...], str] | None = None, within: tuple[str, ...] = ()) -> SectionsT:
    """The one check of every settings file the project reads (the routing service's, stack.toml,
    sim.toml): unknown keys, missing keys and bad values, as one line naming the origin and each
    dotted key (SettingsError: exit code 2 at the command line). ``from_env``: (section, key) ->
    the environment variable that set it (blamed instead of the file)."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise SettingsError(describe_errors(exc, source, from_env or {}, model, within)) from None


def parse_settings(raw: Mapping[str, Any], source: str = "settings",
                   from_env: Mapping[tuple[str, ...], str] | None = None) -> Settings:
    return validate_settings(Settings, raw, source, from_env)


def parse_routing(raw: Mapping[str, Any], source: str = "routing settings") -> RoutingSettings:
    """A [routing] table; a problem names its key from the file's top (``routing.llm-aware.ttft_margin``)."""
    return validate_settings(RoutingSettings, raw, source, within=("routing",))


def describe_errors(exc: ValidationError, source: str, from_env: Mapping[tuple[str, ...], str] | None = None,
                    model: type[BaseModel] | None = None, within: tuple[str, ...] = ()) -> str:
    """One line per problem, each naming its dotted key (``within`` the sections named) and its
    origin (the file, or a variable); an unknown key of ``model`` lists the valid ones."""
    lines = []
    for error in exc.errors():
        path = (*within, *(str(part) for part in error["loc"]))
        key = ".".join(path)
        variable = (from_env or {}).get(path[:3]) or (from_env or {}).get(path[:2])
        origin = f"{variable} (environment)" if variable else source
        if error["type"] == "missing":
            problem = "missing (every setting must be given; there are no defaults)"
        elif error["type"] == "extra_forbidden" and key in MOVED_KEYS:
            problem = f"moved to {MOVED_KEYS[key]}"
        elif error["type"] == "extra_forbidden":
            valid = _valid_keys(model, error["loc"][:-1]) if model else []
            problem = "unknown setting" + (f" (valid: {', '.join(valid)})" if valid else "")
        else:
            problem = f"{error['msg']} (got {error.get('input')!r})"
        lines.append(f"{origin}: {key}: {problem}")
    return "; ".join(lines)


def _valid_keys(model: type[BaseModel], path: tuple[int | str, ...]) -> list[str]:
    """The keys of the section at ``path`` in ``model`` ([] where that is no settings section)."""
    for part in path:
        section = _section_keys(model).get(str(part))
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            return []
        model = section
    return list(_section_keys(model))


def _section_keys(model: type[BaseModel]) -> dict[str, Any]:
    """A section's keys -> their types; one holding named sections of its own (``named_sections``:
    [discovery.<source>]) lists those instead of the field that keeps them."""
    keys = {name: field.annotation for name, field in model.model_fields.items()}
    named = getattr(model, "named_sections", None)
    return keys if named is None else {key: kind for key, kind in keys.items() if key != "sections"} | named()


def apply_env_overrides(raw: dict[str, Any], environ: Mapping[str, str]) -> dict[tuple[str, ...], str]:
    """Set ``raw[section][key]`` from each ``LLM_RING__SECTION__KEY``, and a policy's
    ``raw[section][policy][key]`` from ``LLM_RING__ROUTING__LLM_AWARE__KEY`` (``_`` for the
    name's ``-``, which a variable's name cannot hold); returns which variable set what."""
    origins: dict[tuple[str, ...], str] = {}
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        if len(path) not in (2, 3) or not all(path):
            raise SettingsError(f"{name} (environment): expected {ENV_PREFIX}<SECTION>__<KEY> or "
                                f"{ENV_PREFIX}ROUTING__<POLICY>__<KEY>")
        table = raw.setdefault(path[0], {})
        if len(path) == 3:
            path[1] = path[1].replace("_", "-")
            table = table.setdefault(path[1], {})
        table[path[-1]] = toml_value(text)
        origins[tuple(path)] = name
    return origins


def toml_text(value: Any) -> str:
    """``value`` written as in TOML, what ``toml_value`` reads back as the same value."""
    return tomli_w.dumps({"v": value}).removeprefix("v = ").rstrip("\n")


def toml_value(text: str) -> Any:
    """A value written as in TOML (``0.3``, ``true``, ``"x"``: an environment variable, a
    policy knob); text that is no TOML value stays text."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
