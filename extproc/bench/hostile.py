"""`llm-ring bench hostile`: normal clients while hostile ones hammer the gateway.

Real Envoy + `llm-ring serve` in front of two stub upstreams (extproc.bench.stub_upstream).
  1. stall: the p50 of --clients closed-loop normal chat clients, alone, then while
     --large-bodies clients keep sending a 3.7 MB body of 90,000 messages each;
  2. soak: for --seconds, the normal clients plus hostile ones cycling through every class of
     bad input (bytes that are not UTF-8 in each header the gateway reads, GETs with such an
     x-request-id, wrong JSON types, max_tokens out of range, bodies over the limits,
     malformed JSON, uploads cut off half-way); per class the answers seen, then the
     service's RSS before / at the end / 10 s later, what is left in flight, the stream
     failures the service counted, and whether a valid chat is still routed. RSS is read at
     start, after the large bodies (before the soak), at the soak's end and 10 s later.
--mode pool runs the same through an InferencePool gateway's data plane instead (Envoy AI
Gateway's, full duplex; `llm-ring serve` as its TLS picker): "routed" is then an answer from
a model server the picker chose (x-upstream-host), not x-routed-to.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import random
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from extproc.bench.stubs import start_service_on_stubs
from extproc.envoy.contract import split_host_port
from extproc.service.admin_client import AdminClient
from extproc.service.dataplanes.own_envoy_config import flow_options
from extproc.service.dataplanes.picker_gateways import AI_GATEWAY, UPSTREAM_HEADER
from extproc.settings import load_settings
from extproc.stack.processes import (
    ROUTER_REFERENCE,
    Running,
    start_gateway_envoy,
    start_inference_gateway_envoy,
    start_picker_service,
)

CHAT = "/v1/chat/completions"
JSON = {"content-type": "application/json"}
LARGE_BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}] * 90_000}).encode()


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=60.0, help="soak duration")
    parser.add_argument("--stall-seconds", type=float, default=10.0, help="each half of the stall measurement")
    parser.add_argument("--clients", type=int, default=4, help="normal closed-loop chat clients")
    parser.add_argument("--large-bodies", type=int, default=24, help="clients sending large bodies (stall)")
    parser.add_argument("--hostile", type=int, default=4, help="hostile clients during the soak")
    parser.add_argument("--flow", action="store_true", help="flow control on (router.toml's [flow]): requests "
                        "that find no free slot wait in the router")
    parser.add_argument("--mode", choices=["own", "pool"], default="own",
                        help="own: the gateway's own Envoy configuration; pool: an InferencePool gateway's "
                             "data plane (Envoy AI Gateway's, full duplex, the service as its TLS picker)")


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print(json.dumps(result) if getattr(args, "json", False) else json.dumps(result, indent=2))
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="llm-ring-bench-hostile-"))
    started: list[Running] = []
    try:
        flow = {"LLM_RING__FLOW__ENABLED": "true"} if getattr(args, "flow", False) else {}
        stubbed = start_service_on_stubs(workdir, 2, "llm", flow)
        started += stubbed.processes
        if getattr(args, "mode", "own") == "pool":
            service = start_picker_service(workdir / "picker", stubbed.replicas, more=flow)
            started.append(service)
            envoy = start_inference_gateway_envoy(workdir / "envoy", AI_GATEWAY, service.ext_proc,
                                                  sorted(stubbed.replicas.values()), show_upstream=True)
            listen, metrics, routed_header = service.address, f"http://{service.listen}/metrics", UPSTREAM_HEADER
        else:
            service, listen = stubbed.service, stubbed.service.address
            envoy = start_gateway_envoy(workdir / "envoy", service.ext_proc, stubbed.endpoints, True,
                                        flow=flow_options(load_settings(ROUTER_REFERENCE, environ=flow).flow))
            metrics = "http://" + stubbed.env["LLM_RING__SERVICE__METRICS_LISTEN"].strip('"') + "/metrics"
            routed_header = "x-routed-to"
        started.append(envoy)
        url = f"http://{envoy.listen}"
        time.sleep(1.0)  # Envoy reads the endpoint file
        rss_at_start = _rss_mib(service)
        result: dict[str, Any] = {"stall": asyncio.run(_stall(url, args, routed_header))}
        rss_before = _rss_mib(service)
        soak = asyncio.run(_soak(url, args, routed_header))
        rss_end = _rss_mib(service)
        time.sleep(10.0)
        with AdminClient(listen) as admin:
            in_flight = admin.state()["in_flight_requests"]
        routed = httpx.post(url + CHAT, json=_chat("still routed?"), timeout=10).headers.get(routed_header, "")
        result["soak"] = {
            **soak,
            "rss_mib": {
                "at_start": rss_at_start,
                "after_the_large_bodies": rss_before,
                "end": rss_end,
                "10s_after": _rss_mib(service),
            },
            "in_flight_after": in_flight,
            "stream_failures": _metric_sum(metrics, "llm_ring_stream_failures_total"),
            "valid_chat_routed_to": routed,
        }
        return result
    finally:
        for running in reversed(started):
            running.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 8, **extra}


async def _normal(
    client: httpx.AsyncClient, url: str, until: float, latencies: list[float], name: str, routed_header: str
) -> None:
    for turn in itertools.count():
        if time.monotonic() > until:
            return
        began = time.perf_counter()
        reply = await client.post(url + CHAT, json=_chat(f"{name} turn {turn}"), headers={"x-conversation-id": name})
        if reply.status_code == 200 and reply.headers.get(routed_header):
            latencies.append(time.perf_counter() - began)


def _send_large(url: str, seconds: float, senders: int, answers: Any) -> None:
    """In a process of its own: the bench's loop must not stall its own normal clients."""

    async def sender(client: httpx.AsyncClient, until: float, sent: Counter[int]) -> None:
        while time.monotonic() < until:
            sent[(await client.post(url + CHAT, content=LARGE_BODY, headers=JSON)).status_code] += 1

    async def all_senders() -> Counter[int]:
        sent: Counter[int] = Counter()
        until = time.monotonic() + seconds
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=200)) as client:
            await asyncio.gather(*[sender(client, until, sent) for _ in range(senders)])
        return sent

    answers.put(dict(asyncio.run(all_senders())))


async def _stall(url: str, args: argparse.Namespace, routed_header: str) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    context = multiprocessing.get_context("spawn")
    for label, large in (("alone", 0), ("with_large_bodies", args.large_bodies)):
        latencies: list[float] = []
        answers = context.Queue()
        senders = context.Process(target=_send_large, args=(url, args.stall_seconds + 1.0, large, answers))
        if large:
            senders.start()
            await asyncio.sleep(1.0)  # the large bodies are arriving
        until = time.monotonic() + args.stall_seconds
        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.gather(*[_normal(client, url, until, latencies, f"normal-{i}", routed_header)
                                   for i in range(args.clients)])
        figures[label] = {
            "normal_requests": len(latencies),
            "normal_p50_ms": round(statistics.median(latencies) * 1000, 2) if latencies else None,
            "large_body_answers": answers.get(timeout=60) if large else {},
        }
        if large:
            senders.join(60)
    return figures


def _hostile_requests(routed_header: str) -> list[tuple[str, Callable[[httpx.AsyncClient, str], Any]]]:
    """(class, send) for every kind of bad input; each send returns an outcome label."""

    def post(body: bytes, headers: list[tuple[bytes, bytes]]) -> Callable[[httpx.AsyncClient, str], Any]:
        async def send(client: httpx.AsyncClient, url: str) -> str:
            reply = await client.post(url + CHAT, content=body, headers=headers)
            routed = reply.headers.get(routed_header, "")
            return "routed" if reply.status_code == 200 and routed else str(reply.status_code)

        return send

    async def bad_id_get(client: httpx.AsyncClient, url: str) -> str:
        return str((await client.get(url + CHAT, headers=[(b"x-request-id", b"bad\xff")])).status_code)

    async def cut_upload(client: httpx.AsyncClient, url: str) -> str:
        host, port = split_host_port(url.removeprefix("http://"))
        _, writer = await asyncio.open_connection(host, port)
        writer.write(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 4000000\r\n\r\n" + b'{"messages": [' + b" " * 100_000)  # fmt: skip
        await writer.drain()
        writer.close()
        return "hung up"

    chat = json.dumps(_chat("hi")).encode()
    json_headers = [(b"content-type", b"application/json")]
    wrong = [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": value}]}]} for value in (3, None, ["a"])
    ] + [{"messages": {"role": "user"}}, {"messages": [{"role": 7, "content": "x"}]}, _chat("x", max_tokens="9")]
    return [
        *[
            ("non_utf8_header", post(chat, [*json_headers, (name, b"v\xff\xfe")]))
            for name in (b"x-conversation-id", b"x-turn", b"x-request-id", b"user-agent")
        ],  # fmt: skip
        ("non_utf8_header", post(chat, [(b"content-type", b"application/json\xff")])),
        ("bad_request_id_get", bad_id_get),
        *[("wrong_json_type", post(json.dumps(body).encode(), json_headers)) for body in wrong],
        *[
            ("max_tokens_range", post(json.dumps(_chat("x", max_tokens=v)).encode(), json_headers))
            for v in (2**63 - 1, 0, -1, -5, 10**6)
        ],  # fmt: skip
        ("over_limits", post(LARGE_BODY, json_headers)),
        ("malformed_json", post(b'{"messages": [', json_headers)),
        ("malformed_json", post(bytes(random.Random(7).randbytes(300)), json_headers)),
        ("cut_upload", cut_upload),
    ]


async def _soak(url: str, args: argparse.Namespace, routed_header: str) -> dict[str, Any]:
    until = time.monotonic() + args.seconds
    latencies: list[float] = []
    outcomes: Counter[tuple[str, str]] = Counter()
    requests = _hostile_requests(routed_header)

    async def hostile(offset: int) -> None:
        for index in itertools.count(offset):
            if time.monotonic() > until:
                return
            kind, send = requests[index % len(requests)]
            try:
                outcomes[kind, await send(client, url)] += 1
            except httpx.HTTPError as exc:
                outcomes[kind, type(exc).__name__] += 1

    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=200)) as client:
        await asyncio.gather(
            *[_normal(client, url, until, latencies, f"soak-{i}", routed_header) for i in range(args.clients)],
            *[hostile(i * 7) for i in range(args.hostile)],
        )
    by_class: dict[str, dict[str, int]] = {}
    for (kind, outcome), count in sorted(outcomes.items()):
        by_class.setdefault(kind, {})[outcome] = count
    return {
        "seconds": args.seconds,
        "normal_requests": len(latencies),
        "normal_p50_ms": round(statistics.median(latencies) * 1000, 2) if latencies else None,
        "hostile_requests": sum(outcomes.values()),
        "hostile_by_class": by_class,
    }


def _rss_mib(running: Running) -> dict[str, float]:
    """The service's resident memory, and its body-parsing worker's (offload.py)."""
    process = psutil.Process(running.process.pid)
    workers = sum(child.memory_info().rss for child in process.children(recursive=True))
    return {"service": round(process.memory_info().rss / 2**20, 1), "workers": round(workers / 2**20, 1)}


def _metric_sum(url: str, name: str) -> float:
    text = httpx.get(url, timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))
