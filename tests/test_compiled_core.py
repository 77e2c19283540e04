"""The routing core compiled by mypyc (extproc/compiled.py): it decides exactly as its source,
a build that no longer matches its source is never loaded, and LLM_RING_CORE is checked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import extproc
from extproc import compiled

REPO = Path(__file__).resolve().parent.parent

# Routes a mixed workload through the policies the core compiles and prints every decision.
DRIVER = r"""
import json, random, sys
import extproc
from extproc.bench.decisions import bench_settings, prompt_text
from extproc.routing import Router, RouteRequest
from extproc.routing.blocks import prefix_blocks
import extproc.routing.prefix_index as index_module

out = {"core": extproc.CORE, "index_module": index_module.__file__, "decisions": []}
specs = [{"policy": "llm-aware", "prefix_index": True, "prefix_feedback": True, "replicas.cache_tokens": 30_000},
         {"policy": "llm-aware", "prefix_index": True, "placement_memory": False, "replicas.cache_tokens": 30_000},
         {"policy": "llm-aware"}, {"policy": "bounded"}, {"policy": "bounded", "load_unit": "requests"},
         {"policy": "consistent"}]
for spec in specs:
    rng = random.Random(7)
    replicas = [f"r{n}" for n in range(6)]
    router = Router(bench_settings(**spec), replicas)
    block_chars = router.policy.prefix_block_chars
    in_flight = []
    for number in range(600):
        slot = rng.randrange(30)
        text = prompt_text(slot % 4, slot, rng.randrange(6))
        blocks = prefix_blocks(text, block_chars) if block_chars else ()
        request = RouteRequest(str(number), f"c{slot}", len(text) // 4, 32 + rng.randrange(64), blocks)
        avoid = {f"r{rng.randrange(6)}"} if rng.random() < 0.1 else ()
        ticket = router.route(request, avoid)
        if ticket is None:
            continue
        decision = ticket.decision
        out["decisions"].append([decision.replica, decision.reason, decision.cost, decision.charged_tokens,
                                 decision.predicted_cached_tokens, decision.trace.as_dict()])
        in_flight.append(ticket)
        while len(in_flight) > 12 or (in_flight and rng.random() < 0.3):
            done = in_flight.pop(rng.randrange(len(in_flight)))
            done.release(ok=rng.random() < 0.95)
            made = done.decision
            router.report_cached(done.request, made.replica, made.predicted_cached_tokens,
                                 max(0, made.predicted_cached_tokens - rng.randrange(600)))
        if number == 300:
            router.set_replicas(replicas[:5])  # one replica leaves, its load and blocks with it
        if number == 450:
            router.set_replicas(replicas)
print(json.dumps(out))
"""


def run_driver(core: str) -> dict:
    done = subprocess.run([sys.executable, "-c", DRIVER], env={**os.environ, compiled.ENV: core}, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_compiled_core_decides_exactly_as_its_source() -> None:
    if extproc.CORE != "compiled":
        pytest.skip(f"the compiled core is not in use here ({compiled.describe(extproc.CORE)})")
    as_python, as_compiled = run_driver("python"), run_driver("compiled")
    assert as_python["core"] == "python" and as_python["index_module"].endswith(".py")
    assert as_compiled["core"] == "compiled" and not as_compiled["index_module"].endswith(".py")
    assert len(as_python["decisions"]) > 3_000
    reasons = {row[1] for row in as_python["decisions"]}
    assert {"home", "prefix", "overflow"} <= reasons  # the workload reaches the walk, not only the first pick
    assert as_compiled["decisions"] == as_python["decisions"]


def fake_build(root: Path) -> None:
    """Sources and extension files for every compiled module under ``root``, and a manifest that matches."""
    for module in compiled.MODULES:
        path = root / (module.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {module}\n")
    suffix = compiled.EXTENSION_SUFFIXES[0]
    for name in (*compiled.MODULES, compiled.GROUP + "__mypyc"):
        path = root / "extproc" / "_compiled" / (name.replace(".", "/") + suffix)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(compiled, "PACKAGE", tmp_path / "extproc")
    monkeypatch.setattr(compiled, "BUILT", tmp_path / "extproc" / "_compiled")
    monkeypatch.setattr(compiled, "MANIFEST", tmp_path / "extproc" / "_compiled" / "manifest.json")
    fake_build(tmp_path)
    return tmp_path


def write_manifest(cache_tag: str | None = None) -> None:
    compiled.MANIFEST.write_text(json.dumps({"cache_tag": cache_tag or sys.implementation.cache_tag,
                                             "sources": compiled.digests()}))


def test_a_build_that_matches_its_sources_is_used(tree: Path) -> None:
    assert compiled.stale() == "not built (extproc/_compiled/manifest.json missing or unreadable)"
    write_manifest()
    assert compiled.stale() is None


def test_an_edited_source_makes_the_whole_build_stale(tree: Path) -> None:
    write_manifest()
    (tree / "extproc" / "routing" / "ring.py").write_text("# edited\n")
    assert compiled.stale() == "extproc/routing/ring.py changed since it was built"


def test_a_build_for_another_interpreter_or_with_a_module_missing_is_stale(tree: Path) -> None:
    write_manifest("cpython-399")
    assert compiled.stale() == f"built for cpython-399, running {sys.implementation.cache_tag}"
    write_manifest()
    suffix = compiled.EXTENSION_SUFFIXES[0]
    (tree / "extproc" / "_compiled" / "extproc" / "routing" / ("ledger" + suffix)).unlink()
    assert compiled.stale() == "extproc.routing.ledger not built"


def import_extproc(package_root: Path, core: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "import extproc; print(extproc.CORE)"],
                          env={**os.environ, compiled.ENV: core, "PYTHONPATH": str(package_root)},
                          cwd=package_root, capture_output=True, text=True, timeout=60)


def test_an_unknown_choice_stops_start_up_naming_the_setting() -> None:
    done = import_extproc(REPO, "fast")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "llm-ring: LLM_RING_CORE='fast': expected one of auto, python, compiled\n"


def test_without_a_build_auto_runs_python_and_compiled_refuses(tmp_path: Path) -> None:
    shutil.copytree(REPO / "extproc", tmp_path / "extproc", ignore=shutil.ignore_patterns("_compiled", "__pycache__"))
    auto = import_extproc(tmp_path, "auto")
    assert (auto.returncode, auto.stdout, auto.stderr) == (0, "python\n", "")
    required = import_extproc(tmp_path, "compiled")
    assert required.returncode == 2 and required.stdout == ""
    assert required.stderr == ("llm-ring: LLM_RING_CORE=compiled but the compiled routing core is not built "
                               "(extproc/_compiled/manifest.json missing or unreadable): run 'make setup'\n")
