"""Sleeping replicas as locality, live: 2 xllamacpp replicas of the tiny model with
--sleep-idle-seconds, the routing service (llm-aware) reading each replica's /props, and Envoy."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from extproc.stack import models
from extproc.stack.lab import LocalLab
from extproc.stack.processes import ROUTER_REFERENCE
from extproc.stack.settings import load_stack_settings
from tests.stack.test_live_stack import FREE_PORTS, Chat, conversation_homed_on

pytestmark = pytest.mark.live
IDLE_SECONDS = 4


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalLab]:
    models.prepare("tiny", models.data_dir(), progress=lambda _: None)
    folder = tmp_path_factory.mktemp("sleep")
    router = folder / "router.toml"  # the reference, its replicas' sleep read twice a second
    router.write_text(ROUTER_REFERENCE.read_text().replace("model_status_seconds = 5.0", "model_status_seconds = 0.5"))
    settings = load_stack_settings(overrides={
        "replicas": {"count": 2, "model": "tiny", "ctx_size": 4096, "parallel": 2, "cache_ram_mib": 0,
                     "sleep_idle_seconds": IDLE_SECONDS},
        "ports": FREE_PORTS,
        "router": {"policy": "llm-aware", "settings": str(router)},
        "check": {"profile": "quick"},
    })
    with LocalLab.start(settings, run=folder / "run", progress=lambda _: None) as running:
        yield running


def sleeping(lab: LocalLab, replica: str) -> bool:
    props = httpx.get(f"http://{lab.replicas()[replica]}/props", headers=lab.replica_headers(), timeout=10).json()
    return bool(props["is_sleeping"])


def wait_until(check: object, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_new_conversation_goes_to_the_awake_replica_not_its_sleeping_home(lab: LocalLab) -> None:
    wait_until(lambda: sleeping(lab, "llm-0") and sleeping(lab, "llm-1"), IDLE_SECONDS + 30)
    log = Path(lab.stack.state.run_dir) / "logs" / "router.log"
    # llm-1 woken by a request of its own (the key's holder, not through the gateway)
    wake = {"messages": [{"role": "user", "content": "wake up"}], "max_tokens": 2}
    answer = httpx.post(f"http://{lab.replicas()['llm-1']}/v1/chat/completions", json=wake,
                        headers=lab.replica_headers(), timeout=60)
    assert answer.status_code == 200 and not sleeping(lab, "llm-1")
    time.sleep(1.0)  # two of the routing service's reads
    assert sleeping(lab, "llm-0"), "llm-0 woke: nothing to compare"
    conversation = conversation_homed_on(lab, "llm-0", ["llm-0", "llm-1"], "sleepy")
    reply, _ = Chat(lab.gateway_url, conversation).turn("Tell me about the harbour.")
    assert reply.status_code == 200, reply.text
    assert (reply.headers["x-routed-to"], reply.headers["x-route-reason"]) == ("llm-1", "warm")
    assert sleeping(lab, "llm-0")  # not woken
    assert '"event":"replica_sleep"' in log.read_text()
