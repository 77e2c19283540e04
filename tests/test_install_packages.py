"""scripts/install-redis-server and install-debian-package (run by `make setup`): install Debian's
package only when the binary is missing, with apt-get, and leave the machine without a
policy-rc.d it did not have; in CI every one of them is there."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "install-redis-server"
FAKE_APT = """#!/bin/sh
echo "$@" >> "$APT_LOG"
if [ "$1" = install ]; then touch "$REDIS_SERVER" && chmod +x "$REDIS_SERVER"; fi
"""


def run(tmp_path: Path, server: Path) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "apt-get").write_text(FAKE_APT)
    (bin_dir / "apt-get").chmod(0o755)
    log = tmp_path / "apt.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "APT_LOG": str(log), "REDIS_SERVER": str(server)}
    done = subprocess.run(["sh", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    return done, log.read_text().splitlines() if log.exists() else []


@pytest.mark.skipif(os.geteuid() != 0, reason="installing a package needs root")
def test_a_missing_server_is_installed_with_apt_get_and_its_service_not_started(tmp_path: Path) -> None:
    policy = Path("/usr/sbin/policy-rc.d")
    had_policy = policy.exists()
    server = tmp_path / "redis-server"
    done, calls = run(tmp_path, server)
    assert done.returncode == 0, done.stderr
    assert calls == ["install -y -q --no-install-recommends redis-server"] and server.exists()
    assert policy.exists() == had_policy  # placed only for the install, then removed


def test_a_present_server_is_left_alone(tmp_path: Path) -> None:
    server = tmp_path / "redis-server"
    server.touch(mode=0o755)
    done, calls = run(tmp_path, server)
    assert done.returncode == 0 and calls == [] and done.stdout == ""


@pytest.mark.skipif(os.environ.get("LLM_RING_REQUIRE_SERVERS") != "1", reason="only where .ci/run asks for it")
def test_ci_has_the_redis_server_so_no_store_test_is_skipped() -> None:
    """The store tests skip without redis-server; in CI (.ci/run) that would hide them, so
    there its absence fails here."""
    from extproc.stack.redis_server import redis_server_binary

    assert redis_server_binary() is not None, "scripts/install-redis-server did not install redis-server"


@pytest.mark.skipif(os.environ.get("LLM_RING_REQUIRE_SERVERS") != "1", reason="only where .ci/run asks for it")
@pytest.mark.parametrize("binary", ["/usr/bin/prometheus", "/usr/bin/promtool", "/usr/bin/chromium"])
def test_ci_has_prometheus_and_chromium_so_no_dashboard_or_browser_test_is_skipped(binary: str) -> None:
    assert os.access(binary, os.X_OK), f"make setup (scripts/install-debian-package) did not install {binary}"


def test_the_generic_script_names_what_is_skipped_when_it_cannot_install(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "id").write_text("#!/bin/sh\necho 1000\n")  # not root
    (bin_dir / "id").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    done = subprocess.run(["sh", str(SCRIPT.parent / "install-debian-package"), "prometheus",
                           str(tmp_path / "prometheus"), "the dashboard test"],
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and "the dashboard test will be skipped" in done.stderr


@pytest.mark.skipif(os.environ.get("LLM_RING_REQUIRE_SERVERS") != "1", reason="only where .ci/run asks for it")
def test_ci_has_llama_server_so_the_router_mode_test_is_not_skipped() -> None:
    from extproc.stack import llama_build, models

    assert llama_build.up_to_date(models.data_dir()), "make setup (llm-ring models build-llama-server) built nothing"
