"""The slot sidecar design running locally: two xllamacpp replicas of the tiny model, each
with a slot folder of its own (as Kubernetes pods have), and a sidecar beside each. A slot
saved on one is fetched by the other's sidecar and restored there; a sidecar of another
identity finds nothing (a miss)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from extproc.files import private_secret
from extproc.migration import slotfiles
from extproc.migration.llama import LlamaServer, key_headers
from extproc.migration.sidecar import Sidecars, SidecarSettings, make_server
from extproc.stack import models
from extproc.stack.daemons import Daemon, spawn, stop
from extproc.stack.replicas import ReplicaSettings, command, healthy

pytestmark = pytest.mark.live
KEY = 0x1234ABCD
KEY_FILE = "replica-api-key"  # the replicas' API key, in the pods' root folder


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[str, Path, str]]]:
    """[(replica address, its slot folder, its sidecar address)] x 2, and a third sidecar for
    another identity on the second replica's folder."""
    model = models.prepare("tiny", models.data_dir(), progress=lambda _: None)
    root = tmp_path_factory.mktemp("pods")
    private_secret(root / KEY_FILE)  # one key for both pods' replicas (a Secret mounted into each)
    settings = ReplicaSettings("xllamacpp", model.path, 2048, 2, 1, 0)
    identity = slotfiles.Identity(model.sha256, settings.slot_context, "f16")
    daemons: list[Daemon] = []
    servers = []
    found = []
    try:
        for number in range(2):
            folder = root / f"llm-{number}"
            folder.mkdir()
            port = free_port()
            daemons.append(spawn(command(settings, port, folder, root / KEY_FILE), root / f"llm-{number}.log",
                                 die_with_parent=True))
            sidecar = make_server(("127.0.0.1", 0), SidecarSettings(folder, identity, 2**30, 3600))
            threading.Thread(target=sidecar.serve_forever, daemon=True).start()
            servers.append(sidecar)
            found.append((f"127.0.0.1:{port}", folder, f"127.0.0.1:{sidecar.server_address[1]}"))
        other = make_server(("127.0.0.1", 0), SidecarSettings(found[1][1], replace(identity, model_sha256="0" * 64),
                                                               2**30, 3600))
        threading.Thread(target=other.serve_forever, daemon=True).start()
        servers.append(other)
        found.append(("", found[1][1], f"127.0.0.1:{other.server_address[1]}"))
        deadline = time.monotonic() + 120
        while not all(healthy(address) for address, _, _ in found[:2]):
            assert time.monotonic() < deadline, "replicas not healthy"
            time.sleep(0.1)
        yield found
    finally:
        for server in servers:
            server.shutdown()
        stop(daemons)


def test_a_slot_moves_between_pods_through_their_sidecars_and_another_identity_misses(pods: list) -> None:
    (source, source_folder, source_sidecar), (receiver, receiver_folder, receiver_sidecar), (_, _, other) = pods
    api_key = private_secret(source_folder.parent / KEY_FILE)
    messages = [{"role": "user", "content": "Tell me about the old harbour of the city, its ships and its trade."}]
    first = httpx.post(f"http://{source}/v1/chat/completions", timeout=60, headers=key_headers(api_key),
                       json={"messages": messages, "max_tokens": 8, "ignore_eos": True}).json()
    server = LlamaServer(source, key=api_key)
    slot = max((s for s in server.slots() if s.tokens), key=lambda s: s.last_task)
    model_identity = slotfiles.Identity(models.prepare("tiny", models.data_dir(), lambda _: None).sha256, 1024, "f16")
    stem = slotfiles.stem(model_identity, KEY)
    server.save(slot.id, f"{stem}.bin")
    tokens = slotfiles.read_tokens(source_folder / f"{stem}.bin")
    assert tokens is not None
    slotfiles.write_manifest(source_folder, slotfiles.Manifest(model_identity, KEY, len(tokens), time.time(), "llm-0"))

    assert Sidecars(source_sidecar, {"other": other}).deliver("other", KEY) is None  # another model: a miss
    delivered = Sidecars(source_sidecar, {"llm-1": receiver_sidecar}).deliver("llm-1", KEY)
    assert delivered == (f"{stem}.bin", len(tokens))
    assert (receiver_folder / f"{stem}.bin").read_bytes() == (source_folder / f"{stem}.bin").read_bytes()
    restored = LlamaServer(receiver, key=api_key).restore(0, delivered[0])
    assert restored["n_restored"] == len(tokens)
    follow = [*messages, first["choices"][0]["message"], {"role": "user", "content": "And in winter?"}]
    answer = httpx.post(f"http://{receiver}/v1/chat/completions", timeout=60, headers=key_headers(api_key),
                        json={"messages": follow, "max_tokens": 8, "ignore_eos": True}).json()
    # the first prompt at least (the answer's tokens need not come back the same from its text)
    assert answer["timings"]["cache_n"] >= first["timings"]["prompt_n"] + first["timings"]["cache_n"] - 1
    assert httpx.get(f"http://{source_sidecar}/slots/..%2Fsecret").status_code == 404
