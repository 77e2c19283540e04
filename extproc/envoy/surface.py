"""The gateway's HTTP surface, the same in both data planes: what a client may ask (an allow-list).

A request is exactly one of:
  - a generation: POST on a path llama.cpp serves chat or completions on (with or without
    ``/v1``, one trailing slash allowed): routed, bounded and charged by the router;
  - a read-only request the gateway answers itself: GET the fleet's models (``/v1/models``,
    ``/v1/models/{id}``, ``/models``) or its health (``/health``, ``/v1/health``);
  - a CORS preflight (OPTIONS on one of those paths), answered when service.cors_origins is set;
  - refused: 405 on one of those paths with another method, 404 on every other path.
So llama.cpp's slot, adapter, tokenizer, embedding, props and metrics endpoints are never
reachable through the gateway, whatever the spelling: the match is exact, on the path as the
replica would receive it (its query string aside).
Pure data and functions: our own Envoy's renderer and the service's data planes
(extproc/service/dataplanes/) both read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote

Kind = Literal["chat", "completion"]
ReadOnlyKind = Literal["models", "model", "health"]

# path -> what it generates; every path llama.cpp's server serves chat and completions on
GENERATION_PATHS: dict[str, Kind] = {
    "/v1/chat/completions": "chat",
    "/chat/completions": "chat",
    "/v1/completions": "completion",
    "/completions": "completion",
    "/completion": "completion",
}
MODELS_PATHS = ("/v1/models", "/models")
MODEL_PREFIX = "/v1/models/"  # GET /v1/models/{id}
HEALTH_PATHS = ("/health", "/v1/health")
CORS_METHODS = "GET, POST, OPTIONS"
SERVED_PATHS = ", ".join(GENERATION_PATHS) + ", GET /v1/models and /health"  # what a 404 tells the client


@dataclass(frozen=True, slots=True)
class Generation:
    kind: Kind
    path: str  # the path the replica gets: the client's without a trailing slash
    rewritten: bool  # the client's path differed (a trailing slash): the gateway sets :path


@dataclass(frozen=True, slots=True)
class ReadOnly:
    kind: ReadOnlyKind
    model: str = ""  # kind "model": the id asked for


@dataclass(frozen=True, slots=True)
class Preflight:
    """A CORS preflight on a served path."""


@dataclass(frozen=True, slots=True)
class Refused:
    status: int  # 404 or 405
    message: str
    code: str  # OpenAI error code: "unknown_path" or "method_not_allowed"
    allow: str = ""  # 405: the methods the path takes


Surface = Generation | ReadOnly | Preflight | Refused


def classify(method: str, raw_path: str) -> Surface:
    """What a request with this method and ``:path`` is (module docstring)."""
    path = raw_path.partition("?")[0]
    generation, read_only = generation_path(path), read_only_path(path)
    if generation is None and read_only is None:
        return Refused(404, f"unknown path {bounded_path(path)!r}: the gateway serves {SERVED_PATHS}", "unknown_path")
    wanted = "POST" if generation is not None else "GET"
    if method == wanted:
        return generation if generation is not None else read_only  # type: ignore[return-value]
    if method == "OPTIONS":
        return Preflight()
    return Refused(405, f"method {bounded_path(method)} not allowed on {path}: it takes {wanted}",
                   "method_not_allowed", f"{wanted}, OPTIONS")


def generation_path(path: str) -> Generation | None:
    """The generation a path asks for, exact (one trailing slash removed), or None."""
    kind = GENERATION_PATHS.get(path)
    if kind is not None:
        return Generation(kind, path, False)
    if path.endswith("/"):
        kind = GENERATION_PATHS.get(path[:-1])
        if kind is not None:
            return Generation(kind, path[:-1], True)
    return None


def read_only_path(path: str) -> ReadOnly | None:
    if path in MODELS_PATHS:
        return ReadOnly("models")
    if path in HEALTH_PATHS:
        return ReadOnly("health")
    if path.startswith(MODEL_PREFIX) and len(path) > len(MODEL_PREFIX):
        return ReadOnly("model", unquote(path[len(MODEL_PREFIX):]))  # an id may hold a "/", quoted
    return None


def bounded_path(text: str, limit: int = 80) -> str:
    """A client's path or method as quoted in an error: at most ``limit`` characters."""
    return text if len(text) <= limit else text[:limit] + "..."


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for a status the gateway answers with."""
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_document(status: int, message: str, code: str, param: str | None = None) -> dict[str, dict[str, object]]:
    """An error in OpenAI's shape: the SDKs, LangChain, LiteLLM and the ``llm`` CLI print its message."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}
