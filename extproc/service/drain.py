"""Graceful drain: how the routing service and its Envoy stop without failing a request.

The service, on SIGTERM (``drain``): every gRPC health service turns NOT_SERVING at once
and stays so (the readiness probe fails, so Kubernetes takes the pod out of the gateway
Service), requests already routed finish (up to ``service.drain_seconds``), then the
service stops with exit status 0. Requests that arrive meanwhile (over connections a
client still holds) are still routed: they add to what is waited for, within the same bound.

The pod's ``preStop`` (``python -m extproc.service.drain --envoy-admin ADDR --wait-seconds S``,
run in the router container, which shares the pod's network with Envoy): Envoy's own
SIGTERM closes its listeners at once and resets what is in flight, so the hook first asks
Envoy to drain (``POST /drain_listeners?graceful&skip_exit``: responses carry
``Connection: close``, clients reconnect elsewhere, listeners keep accepting for Envoy's
``--drain-time-s``, and Envoy stays up until its own SIGTERM), then waits ``S`` seconds for
the endpoint's removal to reach every node before Kubernetes sends the router its SIGTERM.
"""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.request
from collections.abc import Callable

import structlog
from grpc_health.v1.health import aio as health_aio

from extproc.cli_input import OneLineParser, at_least

log = structlog.get_logger("extproc.service")
POLL_SECONDS = 0.05
ENVOY_DRAIN_PATH = "/drain_listeners?graceful&skip_exit"


async def drain(in_flight: Callable[[], int], health: health_aio.HealthServicer, bound_seconds: float) -> int:
    """NOT_SERVING for good, then wait until ``in_flight()`` is 0 or ``bound_seconds`` have passed.
    Returns how many requests were still in flight at the end (0: all finished)."""
    await health.enter_graceful_shutdown()  # later set() calls (discovery) are ignored
    started = time.monotonic()
    log.info("drain_started", in_flight=in_flight(), bound_seconds=bound_seconds)
    while (left := in_flight()) and time.monotonic() - started < bound_seconds:
        await asyncio.sleep(POLL_SECONDS)
    seconds = round(time.monotonic() - started, 3)
    if left:  # cut off by the bound
        log.warning("drain_timed_out", left=left, seconds=seconds)
    else:
        log.info("drain_finished", left=0, seconds=seconds)
    return left


def drain_envoy(admin: str, timeout: float = 2.0) -> None:
    """Start Envoy's graceful drain through its admin API (``admin`` = host:port)."""
    request = urllib.request.Request(f"http://{admin}{ENVOY_DRAIN_PATH}", method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        if reply.status != 200:
            raise OSError(f"Envoy admin {admin} answered {reply.status} to {ENVOY_DRAIN_PATH}")


def main(argv: list[str] | None = None) -> int:
    """The preStop hook: drain Envoy, then wait. An unreachable Envoy is reported, not fatal:
    the wait still gives the endpoint's removal its time."""
    parser = OneLineParser(prog="python -m extproc.service.drain", description=main.__doc__)
    parser.add_argument("--envoy-admin", required=True, metavar="HOST:PORT", help="Envoy's admin address")
    parser.add_argument("--wait-seconds", type=at_least(0, float), required=True, metavar="S",
                        help="then wait this long (the endpoint's removal reaching every node)")
    args = parser.parse_args(argv)
    try:
        drain_envoy(args.envoy_admin)
    except OSError as exc:
        print(f"preStop: Envoy's drain not started: {exc}", file=sys.stderr)
    time.sleep(args.wait_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
