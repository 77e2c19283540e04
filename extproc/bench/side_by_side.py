"""`llm-ring bench gateway --flow off on --paced RATE`: flow control's cost when nothing waits,
measured side by side. Three routing services over the same stub replicas, each behind its own
Envoy, are sent the same paced requests at the same time (RATE a second each over 4
connections: below what one service can take, so all three serve the same number whatever the
scheduler favours), window after window:

- "off", a service without flow control; "on", one with it (no slot reserved, room enough that
  every request goes at once; its Envoy configured for flow control); "same", another service
  without it: the noise.
- Each window gives each service's ext_proc CPU per request (/proc) and its median latency;
  the ratios on/off and same/off are taken window by window, so the machine's drift (other work,
  clock speed) hits all three alike, which cells measured one after another cannot give.
- The three are started afresh ``--rounds`` times (sets), in shuffled order: two identical
  services differ by a few percent from one start to the next. Within a set, which service's
  requests go out first at each tick is rotated window by window: sent in a fixed order, the
  service sent last was served a few percent cheaper.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from extproc.bench.gateway_load import bench_requests, cpu_seconds, read_body
from extproc.bench.stubs import (
    FLOW_ENV,
    ROOM_ENV,
    ServiceOnStubs,
    flow_outcomes,
    start_service_on_stubs,
    start_variant_service,
)
from extproc.envoy.contract import split_host_port
from extproc.service.dataplanes.own_envoy_config import flow_options
from extproc.settings import load_settings
from extproc.stack.processes import ROUTER_REFERENCE, Running, start_gateway_envoy

WINDOWS = 9  # per set: each service first at a tick in a third of them
CONNECTIONS = 4  # per service

NAMES = ("off", "on", "same")


async def paced(port: int, connections: int, rate: float, seconds: float) -> tuple[int, float]:
    """Requests sent at ``rate`` a second over ``connections`` for ``seconds``: (answered, median
    latency in ms). A connection behind its pace sends at once, never more than one at a time."""
    requests = bench_requests(200)
    interval = connections / rate
    end = time.perf_counter() + seconds
    latencies: list[float] = []

    async def client(index: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        due = time.perf_counter() + interval * index / connections
        try:
            for number in range(index, 10**9, connections):
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                if time.perf_counter() > end:
                    return
                started = time.perf_counter()
                writer.write(requests[number % len(requests)])
                head = await reader.readuntil(b"\r\n\r\n")
                await read_body(reader, head)
                if not head.startswith(b"HTTP/1.1 200"):
                    raise SystemExit(f"llm-ring bench gateway: {head.split(b' ', 2)[1].decode()} from port {port}")
                latencies.append((time.perf_counter() - started) * 1000)
                due += interval
        finally:
            writer.close()

    await asyncio.gather(*(client(index) for index in range(connections)))
    return len(latencies), statistics.median(latencies) if latencies else float("nan")


async def window(ports: dict[str, int], connections: int, rate: float, seconds: float,
                 first: int = 0) -> dict[str, tuple[int, float]]:
    """The three services sent the same paced requests at once for ``seconds``. The service whose
    requests go out first at each tick is rotated by ``first`` (module docstring)."""
    order = NAMES[first % 3:] + NAMES[:first % 3]
    cells = await asyncio.gather(*(paced(ports[name], connections, rate, seconds) for name in order))
    return dict(zip(order, cells, strict=True))


def start_set(workdir: Path, stubbed: ServiceOnStubs, order: list[str]) -> tuple[dict[str, Running], dict[str, int]]:
    """The three services, started in ``order``, each behind its own Envoy."""
    flow = flow_options(load_settings(ROUTER_REFERENCE, environ=FLOW_ENV).flow)
    services, ports = {}, {}
    for name in order:
        services[name] = start_variant_service(workdir, stubbed, name, FLOW_ENV if name == "on" else {})
    for name in order:
        envoy = start_gateway_envoy(workdir / f"envoy-{name}", services[name].ext_proc, stubbed.endpoints, False, 2,
                                    flow=flow if name == "on" else None)
        services[f"{name} envoy"] = envoy
        ports[name] = split_host_port(envoy.listen)[1]
    return services, ports


def measure_set(services: dict[str, Running], ports: dict[str, int], rate: float, seconds: float,
                ratios: dict[str, list[float]]) -> None:
    """WINDOWS windows, each window's ratios appended to ``ratios``."""
    asyncio.run(window(ports, CONNECTIONS, rate, 1.0))  # warm-up: connections, caches
    for number in range(1, WINDOWS + 1):
        before = {name: cpu_seconds(services[name]) for name in NAMES}
        cells = asyncio.run(window(ports, CONNECTIONS, rate, seconds, number))
        cpu = {name: (cpu_seconds(services[name]) - before[name]) / max(cells[name][0], 1) * 1e6 for name in NAMES}
        for name in ("on", "same"):
            ratios[f"{name} cpu"].append(cpu[name] / cpu["off"])
            ratios[f"{name} p50"].append(cells[name][1] / cells["off"][1])
        _progress(f"window {number}/{WINDOWS}: CPU us/request off {cpu['off']:.0f} on {cpu['on']:.0f} "
                  f"same {cpu['same']:.0f}; requests {cells['off'][0]} / {cells['on'][0]} / {cells['same'][0]}; "
                  f"load {os.getloadavg()[0]:.1f}")


def run_side_by_side(args: argparse.Namespace) -> dict[str, Any]:
    """--rounds sets of WINDOWS windows of --seconds at --paced requests a second; the ratios."""
    sets, seconds, rate = max(1, int(args.rounds)), float(args.seconds), float(args.paced)
    workdir = Path(tempfile.mkdtemp(prefix="llm-ring-bench-side-by-side-"))
    stubbed = start_service_on_stubs(workdir, 3, "stub", ROOM_ENV)
    pooled: dict[str, list[float]] = {"on cpu": [], "same cpu": [], "on p50": [], "same p50": []}
    per_set = []
    try:
        for number in range(sets):
            order = random.Random(number).sample(NAMES, len(NAMES))
            services, ports = start_set(workdir / f"set-{number}", stubbed, order)
            try:
                ratios: dict[str, list[float]] = {key: [] for key in pooled}
                measure_set(services, ports, rate, seconds, ratios)
                at_once = flow_outcomes(services["on"])
            finally:
                for running in reversed(services.values()):
                    running.stop()
            medians = {key: round(statistics.median(values), 3) for key, values in ratios.items()}
            per_set.append({"started": order, **medians, "flow": at_once})
            _progress(f"set {number + 1}/{sets} (started {', '.join(order)}): CPU per request on/off "
                      f"{medians['on cpu']:.3f}, same/off {medians['same cpu']:.3f}")
            for key, values in ratios.items():
                pooled[key] += values
    finally:
        for running in reversed(stubbed.processes):
            running.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"rate": rate, "seconds": seconds, "sets": per_set, "cpus": os.cpu_count(),
            "ratios": {key: _spread(values) for key, values in pooled.items()}}


def render_side_by_side(result: dict[str, Any]) -> str:
    lines = [f"flow control off and on side by side, with an identical service (same) as the noise: "
             f"{len(result['sets'])} sets of {WINDOWS} windows of {result['seconds']:g} s, {result['rate']:g} "
             f"requests a second to each service, {result['cpus']} CPUs; window by window, median (quartiles):"]
    names = {"on cpu": "ext_proc CPU per request, on / off", "same cpu": "ext_proc CPU per request, same / off",
             "on p50": "median latency, on / off", "same p50": "median latency, same / off"}
    for key, (median, low, high) in result["ratios"].items():
        lines.append(f"  {names[key]:>38}: {median:.3f} ({low:.3f}-{high:.3f})")
    routed = sum(one["flow"]["at_once"] for one in result["sets"])
    queued = sum(one["flow"]["other"] for one in result["sets"])
    lines.append(f"flow control: {routed} requests routed at once, {queued} otherwise")
    return "\n".join(lines)


def _spread(values: list[float]) -> tuple[float, float, float]:
    quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return round(statistics.median(values), 3), round(quartiles[0], 3), round(quartiles[2], 3)


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
