"""The migration port's shared secret: each call carries ``authorization: Bearer <token>``
(the token: service.migration_token_file on the router, sidecar.router_token_file on a
slot sidecar). A call without it, or with another, is refused with UNAUTHENTICATED before
it reaches the service."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

KEY = "authorization"  # gRPC metadata keys are lower case
Metadata = tuple[tuple[str, str], ...]


def bearer_metadata(token: str | None) -> Metadata:
    """What a client sends with every call (nothing without a token)."""
    return ((KEY, f"Bearer {token}"),) if token else ()


class BearerCheck(grpc.aio.ServerInterceptor):
    """Lets through only calls carrying ``token``; ``on_refused`` runs once per refused call."""

    def __init__(self, token: str, on_refused: Callable[[], None]) -> None:
        self._expected = bearer_metadata(token)[0][1].encode()
        self._on_refused = on_refused
        self._refusal = grpc.unary_unary_rpc_method_handler(_refuse)  # every Admin method is unary

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        if self._carries_token(details.invocation_metadata or ()):
            return await continuation(details)
        self._on_refused()
        return self._refusal

    def _carries_token(self, metadata: Metadata) -> bool:
        presented = next((value for key, value in metadata if key == KEY), "")
        # constant time: how long a refusal takes tells nothing about how much of the token matched
        return hmac.compare_digest(presented.encode() if isinstance(presented, str) else presented, self._expected)


async def _refuse(request: bytes, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "the migration port wants authorization: Bearer <token>")
