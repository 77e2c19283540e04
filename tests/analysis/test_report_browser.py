"""The HTML report as a person sees it: opened offline in Debian's headless Chromium, every
chart is drawn by the page's own Vega (its marks are in the DOM), and a screenshot shows it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from analysis.fixtures import make_experiment
from extproc.cli import main

pytestmark = pytest.mark.live  # starts a browser
CHARTS = ("summary", "hit_rate_over_time", "latency_ttft", "route_reasons", "learnt_speeds")


def chromium() -> str:
    """Debian's chromium (scripts/install-debian-package, `make setup`): skipped where it could
    not be installed, but not in CI (.ci/run), where its absence fails."""
    found = shutil.which("chromium") or shutil.which("chromium", path="/usr/bin")
    if not found:
        if os.environ.get("LLM_RING_REQUIRE_SERVERS") == "1":
            pytest.fail("chromium is missing: scripts/install-debian-package chromium did not install it")
        pytest.skip("chromium is missing (make setup installs Debian's chromium)")
    return found


def headless(page: Path, profile: Path, *what: str) -> subprocess.CompletedProcess[str]:
    """Chromium on the file, offline (no proxy, no network service reachable), its scripts given
    10 s of virtual time to draw."""
    return subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--user-data-dir={profile}", "--proxy-server=127.0.0.1:9", "--virtual-time-budget=10000",
         *what, page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_every_chart_of_the_report_draws_its_marks_in_chromium(tmp_path: Path, capsys) -> None:
    live, sim = make_experiment(tmp_path / "live"), tmp_path / "sim"
    assert main(["sim", "--profile", "quick", "--policies", "bounded", "llm-aware", "--seeds", "1-2",
                 "--cost-model", "smollm2-135m:1", "qwen05b-shape:1", "--slow", "llm-1:4:3",
                 "--out-dir", str(sim)]) == 0  # fmt: skip
    page = tmp_path / "report.html"
    assert main(["report", str(live), str(sim), "--html", str(page)]) == 0
    capsys.readouterr()
    dumped = headless(page, tmp_path / "profile", "--dump-dom")
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    body = dumped.stdout[: dumped.stdout.index('<script type="application/json"')]  # the page before its scripts
    drawn = {}
    for part in body.split('<div class="chart')[1:]:
        name = re.search(r'id="chart-(\w+)"', part)[1]
        # a mark group with something in it: vega-embed drew the chart as SVG
        drawn[name] = len(re.findall(r'class="mark-\w+ role-mark[^"]*"[^>]*><(?:path|text|line)', part))
        assert "failed to draw" not in part, name
    assert set(drawn) == set(CHARTS) and all(drawn.values()), drawn
    shot = tmp_path / "report.png"
    taken = headless(page, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1200,2400")
    assert taken.returncode == 0 and shot.read_bytes()[:4] == b"\x89PNG" and shot.stat().st_size > 50_000
