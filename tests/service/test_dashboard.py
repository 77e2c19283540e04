"""The Grafana dashboard (grafana/dashboard.py): every panel's query, run by Debian's Prometheus
scraping a live router (real Envoy, real llama.cpp replicas) through the local job of
grafana/prometheus-scrape.yml, returns at least one series; the committed JSON and ConfigMap
are the generator's rendering; the Kubernetes objects are valid."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml

from extproc.stack.processes import Running, free_port, spawn_child, static_discovery, wait_until_ready
from tests.k8s.k8s_support import load_docs, schema_version
from tests.service.gateway_support import back_to_back, gateway, llama_replicas

GRAFANA = Path(__file__).parents[2] / "grafana"
ONE_SLOT = {"slots": "1", "reserved_slots": "0"}  # flow control on: a third request waits
MONITORING = Path(__file__).parents[2] / "k8s" / "monitoring"
SCRAPE = GRAFANA / "prometheus-scrape.yml"
# what Grafana puts in place of its variables: every router, a one-minute rate window
GRAFANA_VARIABLES = {"$instance": ".*", "$__rate_interval": "1m"}


@functools.cache
def dashboard_module() -> ModuleType:
    """grafana/dashboard.py (a script, not a package), registered as a module for its dataclass."""
    spec = importlib.util.spec_from_file_location("grafana_dashboard", GRAFANA / "dashboard.py")
    assert spec and spec.loader
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def debian_binary(name: str) -> str:
    """Debian's prometheus or promtool (scripts/install-debian-package, `make setup`): skipped
    where it could not be installed, but not in CI (.ci/run), where its absence fails."""
    found = shutil.which(name) or shutil.which(name, path="/usr/bin")
    if not found:
        if os.environ.get("LLM_RING_REQUIRE_SERVERS") == "1":
            pytest.fail(f"{name} is missing: scripts/install-debian-package prometheus did not install it")
        pytest.skip(f"{name} is missing (make setup installs Debian's prometheus)")
    return found


def test_committed_dashboard_and_configmap_are_the_generators_rendering() -> None:
    stale = [path.name for path, text in dashboard_module().rendered().items() if path.read_text() != text]
    assert not stale, f"out of date, run .venv/bin/python grafana/dashboard.py: {stale}"


def test_the_configmap_holds_the_dashboard_json_and_the_objects_are_valid() -> None:
    dashboard = json.loads((GRAFANA / "llm-ring-router.json").read_text())
    docs = [doc for path in sorted(MONITORING.glob("*.yaml")) for doc in load_docs(path)]
    for doc in docs:
        kubernetes_validate.validate(doc, schema_version(), strict=True)
    (configmap,) = [doc for doc in docs if doc["kind"] == "ConfigMap"]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["llm-ring-router.json"]) == dashboard
    assert {panel["datasource"]["uid"] for panel in dashboard["panels"]} == {"${datasource}"}


def test_the_scrape_example_is_a_valid_prometheus_config() -> None:
    checked = subprocess.run([debian_binary("promtool"), "check", "config", str(SCRAPE)],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


def in_grafana(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def series(prometheus: str, expr: str) -> list[dict[str, Any]]:
    reply = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert reply["status"] == "success", (expr, reply)
    return reply["data"]["result"]


@pytest.mark.live
def test_every_panel_query_returns_data_from_a_live_router(prometheus: str) -> None:
    module = dashboard_module()
    expressions = [in_grafana(expr) for expr in module.queries()]
    expressions.append("llm_ring_decision_seconds_count")  # the router picker's label_values()
    deadline = time.monotonic() + 30  # a few scrapes at 1 s
    empty = expressions
    while empty and time.monotonic() < deadline:
        empty = [expr for expr in expressions if not series(prometheus, expr)]
        time.sleep(1)
    assert not empty, f"queries that return no series: {empty}"
    assert len(module.PANELS) >= 12
    misspelt = in_grafana(module.rate("llm_ring_decision_total", "reason"))  # the yardstick: a wrong name finds nothing
    assert series(prometheus, misspelt) == []


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Debian's Prometheus scraping a live router every second, after a few conversations
    through it (streamed and not, three at once: with flow control on and one slot a replica,
    some wait in the router): its HTTP API's URL."""
    binary = debian_binary("prometheus")
    workdir = tmp_path_factory.mktemp("prometheus")
    metrics = f"127.0.0.1:{free_port()}"
    with llama_replicas(workdir / "replicas") as replicas, \
            gateway(workdir, static_discovery(replicas.addresses), replica_key_file=replicas.key_file,
                    metrics_listen=f'"{metrics}"', flow=ONE_SLOT) as gw:  # fmt: skip
        server = _start(binary, workdir, metrics)
        try:
            with ThreadPoolExecutor(3) as pool:
                turns = list(pool.map(lambda args: back_to_back(gw.url, *args, with_header=True),
                                      ((1, False), (2, True), (3, False))))
            assert all(len(conversation) == 4 for conversation in turns)
            yield server.address
        finally:
            server.stop()


def _start(binary: str, workdir: Path, target: str) -> Running:
    """Prometheus with the example's local job, aimed at ``target`` and scraping every second."""
    jobs = yaml.safe_load(SCRAPE.read_text())["scrape_configs"]
    (job,) = [job for job in jobs if job["job_name"] == "llm-ring-local"]
    job.update(static_configs=[{"targets": [target]}], scrape_interval="1s")
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": [job]}))
    listen = f"127.0.0.1:{free_port()}"
    running = spawn_child("prometheus", [
        binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address={listen}", "--log.level=warn",
    ], workdir / "prometheus.log")  # fmt: skip
    running.address = f"http://{listen}"
    try:
        wait_until_ready(running, lambda: _ready(running.address), 30.0)
    except BaseException:
        running.stop()
        raise
    return running


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
