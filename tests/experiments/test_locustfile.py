"""A plain `locust -f locustfiles/chat.py --headless ...` keeps the checkout clean; records only where asked."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import httpx

from experiments.labs import free_port
from experiments.test_run import TINY
from extproc.experiments.run import LOCUSTFILE


def _locust(cwd, host, *extra):
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", "2", "-r", "10",
               "--host", host, "-t", "60s", "--only-summary", "--traffic-profile", str(cwd / "tiny.json"), *extra]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=180)


def test_records_are_written_only_to_records_dir(tmp_path):
    (tmp_path / "tiny.json").write_text(json.dumps(dataclasses.asdict(TINY)))
    port = free_port()
    stub = subprocess.Popen([sys.executable, "-m", "extproc.bench.stub_upstream", str(port)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "stub upstream did not start"
                time.sleep(0.2)
        plain = _locust(tmp_path, f"http://127.0.0.1:{port}")
        assert "request rows not kept (no --records-dir)" in plain.stdout + plain.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.json"]
        asked = _locust(tmp_path, f"http://127.0.0.1:{port}", "--records-dir", str(tmp_path / "run"))
        assert "4 request rows ->" in asked.stdout + asked.stderr, asked.stdout + asked.stderr
        assert (tmp_path / "run" / "requests.parquet").exists()
    finally:
        stub.terminate()
        stub.wait(timeout=10)
