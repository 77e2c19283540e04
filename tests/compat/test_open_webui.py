"""Open WebUI's backend in front of the gateway, in both data planes: OPT-IN
(LLM_RING_COMPAT_OPENWEBUI=1), skipped otherwise: its install is large and slow (docs/testing.md).

Open WebUI is set up as its documentation says for an OpenAI-compatible server and nothing else:
OPENAI_API_BASE_URL and a key, no Ollama, no login (WEBUI_AUTH=False), offline. Its backend
then lists the fleet's models and chats with no manual step (no model id typed in): its own API,
the one its web page calls, lists "smollm2", and a chat of three turns through it, JSON and
streamed, stays on the replica holding its cache.

It is not pinned with the project: it lives in a venv of its own, made on first use under the
data directory (``<data dir>/compat/open-webui-<version>``, or LLM_RING_COMPAT_OPENWEBUI_VENV)
with ``pip install open-webui==<version>`` and kept; the install's time is printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from extproc.stack.models import data_dir
from extproc.stack.processes import Running, free_port, spawn_child, wait_until_ready
from tests.compat.clients import MODEL
from tests.service.gateway_support import Gateway, assert_each_turn_reused_the_whole_previous_prompt

VERSION = "0.12.4"
ENABLE = "LLM_RING_COMPAT_OPENWEBUI"
pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(os.environ.get(ENABLE) != "1",
                       reason=f"opt-in: {ENABLE}=1 installs Open WebUI {VERSION} in a venv of its own "
                              "(about 3 min and 7 GB, once) and starts its backend"),
]
TURNS = ("Name a colour.", "Name a fruit of that colour.", "And a vegetable?")


def open_webui_venv() -> Path:
    """The venv holding Open WebUI, made (and timed) when missing."""
    venv = Path(os.environ.get(f"{ENABLE}_VENV") or data_dir() / "compat" / f"open-webui-{VERSION}")
    command = venv / "bin" / "open-webui"
    if command.exists():
        return venv
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    installed = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", f"open-webui=={VERSION}"],
                               capture_output=True, text=True)
    if installed.returncode != 0 or not command.exists():
        pytest.fail(f"pip install open-webui=={VERSION} failed:\n{installed.stderr[-3000:]}")
    print(f"Open WebUI {VERSION} installed in {time.monotonic() - started:.0f} s into {venv}")
    return venv


@pytest.fixture(scope="module")
def venv() -> Path:
    return open_webui_venv()


@pytest.fixture(scope="module")
def open_webui(venv: Path, plane: Gateway, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Open WebUI's backend pointed at the plane, its data in a folder of its own: its URL."""
    tmp_path = tmp_path_factory.mktemp("open-webui")
    port = free_port()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "DATA_DIR": str(tmp_path / "data"),
        "OPENAI_API_BASE_URL": plane.url + "/v1", "OPENAI_API_KEY": "sk-any",
        "ENABLE_OLLAMA_API": "False", "WEBUI_AUTH": "False", "WEBUI_SECRET_KEY": "compat-suite",
        # no network here: no model downloads (its RAG embedder then logs that it has none), no update check
        "OFFLINE_MODE": "True", "HF_HUB_OFFLINE": "1", "ENABLE_VERSION_UPDATE_CHECK": "False",
    }
    running: Running = spawn_child("open-webui", [str(venv / "bin" / "open-webui"), "serve", "--host", "127.0.0.1",
                                                  "--port", str(port)], tmp_path / "open-webui.log", env)
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    try:
        wait_until_ready(running, lambda: _healthy(url), 300.0)
        print(f"Open WebUI's backend up in {time.monotonic() - started:.0f} s")
        yield url
    finally:
        running.stop(timeout=15)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _token(url: str) -> dict[str, str]:
    """Without login (WEBUI_AUTH=False) the page signs in with empty credentials as the admin."""
    signed = httpx.post(url + "/api/v1/auths/signin", json={"email": "", "password": ""}, timeout=30)
    assert signed.status_code == 200, signed.text
    return {"authorization": f"Bearer {signed.json()['token']}"}


def _answer(reply: httpx.Response, stream: bool) -> str:
    assert reply.status_code == 200, reply.text
    if not stream:
        return str(reply.json()["choices"][0]["message"]["content"] or "")
    events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    return "".join((e["choices"][0].get("delta") or {}).get("content") or "" for e in events if e.get("choices"))


def test_open_webui_lists_the_fleets_models_with_no_manual_step(open_webui: str) -> None:
    listed = httpx.get(open_webui + "/api/models", headers=_token(open_webui), timeout=60)
    assert listed.status_code == 200, listed.text
    assert [model["id"] for model in listed.json()["data"]] == [MODEL]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
def test_a_chat_through_open_webui_stays_on_the_replica_holding_its_cache(
    open_webui: str, plane: Gateway, stream: bool
) -> None:
    headers = _token(open_webui)
    messages = [{"role": "system", "content": f"You are Open WebUI's assistant ({stream=}). One word."}]
    seen = len(plane.decisions())
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        reply = httpx.post(open_webui + "/api/chat/completions", headers=headers, timeout=120,
                           json={"model": MODEL, "messages": messages, "stream": stream, "max_tokens": 6})
        messages.append({"role": "assistant", "content": _answer(reply, stream)})
    turns = plane.decisions_after(seen, len(TURNS))
    assert all(t["stream"] is stream and t["outcome"] == "ok" for t in turns), turns
    assert_each_turn_reused_the_whole_previous_prompt(turns[:len(TURNS)])
