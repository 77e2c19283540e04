"""CORS: which browser origins may call the gateway (service.cors_origins), as response headers.

Pure. Our own Envoy gets the same policy rendered into its CORS filter
(service/dataplanes/own_envoy_config.py); an Endpoint Picker's gateway gets these headers in the
service's answers (service/dataplanes/picker.py). Either way the replica's own CORS headers are
removed from its answers first (REPLICA_CORS_HEADERS).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from extproc.envoy.surface import CORS_METHODS

# what an OpenAI client sends besides the CORS-safelisted headers; "*" (any other name, for a
# request without credentials, as the SDKs send theirs: x-stainless-os, ...) never covers authorization
ALLOWED_HEADERS = "authorization, content-type, x-conversation-id, x-turn, x-request-id, openai-organization, " \
                  "openai-project, *"
EXPOSED_HEADERS = "x-request-id"
MAX_AGE_S = 600
# A replica's own CORS headers: llama.cpp's server echoes whatever Origin a request carries as
# access-control-allow-origin (an empty one when it carries none). Removed from every answer
# that passes through the gateway, in both data planes: this policy alone says which origins may read.
REPLICA_CORS_HEADERS = ("access-control-allow-origin", "access-control-allow-credentials",
                        "access-control-allow-methods", "access-control-allow-headers",
                        "access-control-expose-headers", "access-control-max-age")


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    origins: frozenset[str]  # exact origins, or "*" for any

    @property
    def enabled(self) -> bool:
        return bool(self.origins)

    @staticmethod
    def replica_headers_removed(kept: Sequence[tuple[str, str]]) -> list[str]:
        """The CORS headers to remove from a replica's answer: all but those the gateway sets."""
        ours = {name for name, _ in kept}
        return [name for name in REPLICA_CORS_HEADERS if name not in ours]

    def answer_headers(self, origin: str) -> list[tuple[str, str]]:
        """The headers an answer to a request from ``origin`` carries: none unless it is allowed."""
        if not origin or not (origin in self.origins or "*" in self.origins):
            return []
        return [("access-control-allow-origin", origin), ("access-control-expose-headers", EXPOSED_HEADERS),
                ("vary", "origin")]

    @staticmethod
    def preflight_headers(requested_headers: str) -> list[tuple[str, str]]:
        """A preflight's extra headers: the methods served, and the headers asked for when given
        (browsers send only the names they need), else the ones OpenAI clients use."""
        return [("access-control-allow-methods", CORS_METHODS),
                ("access-control-allow-headers", requested_headers[:1024] or ALLOWED_HEADERS),
                ("access-control-max-age", str(MAX_AGE_S))]
