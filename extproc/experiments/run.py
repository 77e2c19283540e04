"""`llm-ring run`: the same traffic under each policy, several seeds, one folder.

For every seed, every policy runs once (order alternated between seeds, so no
policy always runs first on a cold or last on a hot machine). Before each run the
lab is scaled back, reset (fresh caches, fresh router state) and set to the policy;
every replica answers one short warm-up request directly so that first-inference
costs stay out of the measurements. Locust runs as a subprocess (its gevent
monkey-patching stays out of this process) and journals each request; the rows
already recorded survive an interrupted run. With several gateways (a GatewayTier lab)
one of them, or their store, can be SIGKILLed mid-run and restarted (--kill-gateway,
--kill-store, --restart-after);
after every run each router's in-flight load is read back (run.json: routers_after). Layout:

    OUT_DIR/experiment.json, profile.json, summary.md
    OUT_DIR/<policy>-s<seed>/requests.parquet, run.json, locust.log
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import json
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from extproc.cli_input import UsageError, new_folder, parse_seeds
from extproc.experiments.lab import GatewayTier, Lab, LabError, RemoteLab
from extproc.policy_spec import POLICIES, ExperimentError, PolicySpec, parse_policy
from extproc.records import (
    JOURNAL_FILE,
    REQUESTS_FILE,
    RunMeta,
    finalise_run_records,
    read_records,
    read_run_metadata,
    utc_now,
    write_run_metadata,
)
from extproc.stack.gateways import STORE
from extproc.traffic import Profile, ProfileError, check_context, generate_conversations
from extproc.traffic import load_profile as load_traffic_profile
from extproc.traffic.chat import session_tag

LOCUSTFILE = Path(__file__).resolve().parents[2] / "locustfiles" / "chat.py"
PROGRESS_EVERY_S = 5.0
SETTLE_S = 10.0  # after a run, how long the routers may take to release what was in flight


@dataclasses.dataclass(frozen=True)
class Kill:
    """SIGKILL a part of the lab at_s seconds into every run, start it again restart_after_s
    seconds later (at the run's end at the latest). part: "gateway" (the last one) or "store"."""

    at_s: float
    restart_after_s: float
    part: str = "gateway"

    @property
    def option(self) -> str:
        return f"--kill-{self.part}"


class ExperimentInterrupted(RuntimeError):
    def __init__(self, run_dir: Path) -> None:
        super().__init__(f"interrupted during {run_dir.name}; rows recorded so far are in {run_dir}")
        self.run_dir = run_dir


def run_order(policies: Sequence[str], seeds: Sequence[int]) -> list[tuple[str, int]]:
    """Policies x seeds, the policy order reversed on every other seed."""
    order = []
    for number, seed in enumerate(seeds):
        ordered = list(policies) if number % 2 == 0 else list(reversed(policies))
        order += [(policy, seed) for policy in ordered]
    return order


def run_experiment(
    lab: Lab,
    profile: Profile,
    policies: Sequence[str],
    seeds: Sequence[int],
    out_dir: str | Path,
    scale_at: float | None = None,
    progress: Callable[[str], None] | None = None,
    kill: Kill | None = None,
    roll: Roll | None = None,
    new_connections: bool = False,
) -> Path:
    """Run every policy x seed against ``lab``; returns the experiment folder. new_connections:
    every request on a connection of its own (Locust's --new-connections)."""
    say = progress or (lambda text: print(text, file=sys.stderr, flush=True))
    out = Path(out_dir)
    specs = _check_inputs(lab, profile, policies, seeds, out, scale_at, kill)
    option = "--scale-in-at" if roll is not None and roll.scale_in else "--roll-at"
    if roll is not None and not roll.at_s > 0:
        raise ExperimentError(f"{option} must be > 0 seconds (got {roll.at_s:g})")
    if roll is not None and not callable(getattr(lab, "roll", None)):  # a lab that restarts replicas
        raise ExperimentError(f"{option} needs the local stack (this lab cannot restart replicas)")
    if roll is not None and roll.scale_in and len(lab.replicas()) < 2:
        raise ExperimentError("--scale-in-at needs at least 2 replicas")
    expected = {seed: sum(c.requests for c in generate_conversations(profile, seed)) for seed in seeds}
    start_replicas = len(lab.replicas())
    out.mkdir(parents=True)
    profile_path = out / "profile.json"
    profile_path.write_text(json.dumps(dataclasses.asdict(profile), indent=2) + "\n")
    plan = run_order([s.label for s in specs], seeds)
    (out / "experiment.json").write_text(
        json.dumps(
            {
                "gateway": lab.gateway_url,
                "profile": profile.name,
                "policies": list(policies),
                "seeds": list(seeds),
                "order": [f"{p}-s{s}" for p, s in plan],
                "scale_at_s": scale_at,
                "kill": dataclasses.asdict(kill) if kill else None,
                "roll": dataclasses.asdict(roll) if roll else None,
                "new_connections": new_connections,
                "replicas": start_replicas,
                "model": served_model(lab.gateway_url),  # what the requests name (the simulator keys by it too)
                "started_at": utc_now(),
                "versions": versions(),
            },
            indent=2,
        )
        + "\n"
    )
    by_label = {s.label: s for s in specs}
    for number, (label, seed) in enumerate(plan, start=1):
        step = f"[{number}/{len(plan)}]"
        say(f"{step} {label} seed {seed}: preparing")
        _run_one(lab, profile, profile_path, by_label[label], seed, out, scale_at, start_replicas,
                 expected[seed], functools.partial(_prefixed, say, step), kill, roll, new_connections)  # fmt: skip
    if len(lab.replicas()) != start_replicas:
        lab.scale(start_replicas)
    return out


def _prefixed(say: Callable[[str], None], prefix: str, text: str) -> None:
    say(f"{prefix} {text}")


def _check_inputs(
    lab: Lab,
    profile: Profile,
    policies: Sequence[str],
    seeds: Sequence[int],
    out: Path,
    scale_at: float | None,
    kill: Kill | None = None,
) -> list[PolicySpec]:
    new_folder(out)
    if not policies:
        raise ExperimentError("no policies given")
    if not seeds or len(set(seeds)) != len(seeds):
        raise ExperimentError(f"seeds must be distinct and at least one (got {list(seeds)})")
    if scale_at is not None and scale_at <= 0:
        raise ExperimentError(f"--scale-at must be > 0 seconds (got {scale_at})")
    if kill is not None:
        _check_kill(lab, kill)
    specs = [parse_policy(p) for p in policies]
    if len({s.label for s in specs}) != len(specs):
        raise ExperimentError(f"a policy is listed twice: {list(policies)}")
    for seed in seeds:
        generate_conversations(profile, seed)  # a first turn too long for the context fails here
    check_gateway(lab.gateway_url)
    for name, address in lab.replicas().items():
        slot = slot_context(address, lab.replica_headers())
        if slot is not None:
            try:
                check_context(profile, slot)
            except ProfileError as exc:
                raise ExperimentError(f"replica {name}: {exc}") from None
    return specs


def _check_kill(lab: Lab, kill: Kill) -> None:
    if kill.part not in ("gateway", "store"):
        raise ExperimentError(f"kill: part must be gateway or store (got {kill.part!r})")
    if not kill.at_s > 0:
        raise ExperimentError(f"{kill.option} must be > 0 seconds (got {kill.at_s:g})")
    if not kill.restart_after_s >= 0:
        raise ExperimentError(f"--restart-after must be >= 0 seconds (got {kill.restart_after_s:g})")
    gateways = len(lab.routers()) if isinstance(lab, GatewayTier) else 1
    if gateways < 2:
        raise ExperimentError(f"{kill.option} needs a lab with 2 or more gateways (this one has {gateways}; "
                              "llm-ring up --gateways 2)")


def check_gateway(url: str, timeout: float = 3.0) -> None:
    """Any HTTP answer means the gateway is up; no answer is a clear error."""
    try:
        httpx.get(url, timeout=timeout)
    except httpx.HTTPError as exc:
        raise ExperimentError(
            f"gateway {url} is not reachable ({type(exc).__name__}: {exc}); is the stack up? (llm-ring status)"
        ) from None


def slot_context(address: str, headers: dict[str, str], timeout: float = 5.0) -> int | None:
    """A llama.cpp replica's per-slot context (GET /props), or None if it does not say.
    headers: the replicas' key (Lab.replica_headers)."""
    try:
        props = httpx.get(f"http://{address}/props", headers=headers, timeout=timeout).json()
        return int(props["default_generation_settings"]["n_ctx"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def warm_up(replicas: dict[str, str], headers: dict[str, str], timeout: float = 300.0) -> None:
    """One tiny request per replica, straight to it (the router never sees it); headers: the
    replicas' key (Lab.replica_headers)."""
    body = {"messages": [{"role": "user", "content": "warm-up"}], "max_tokens": 2, "ignore_eos": True}
    for name, address in replicas.items():
        try:
            httpx.post(f"http://{address}/v1/chat/completions", json=body, headers=headers, timeout=timeout)
        except httpx.HTTPError as exc:
            raise LabError(f"warm-up of replica {name} ({address}) failed: {exc}") from None


def _run_one(
    lab: Lab,
    profile: Profile,
    profile_path: Path,
    spec: PolicySpec,
    seed: int,
    out: Path,
    scale_at: float | None,
    start_replicas: int,
    expected: int,
    say: Callable[[str], None],
    kill: Kill | None = None,
    roll: Roll | None = None,
    new_connections: bool = False,
) -> None:
    run_id = f"{spec.label}-s{seed}"
    run_dir = out / run_id.replace(":", "_").replace(",", "_").replace("=", "-")
    if len(lab.replicas()) != start_replicas:
        lab.scale(start_replicas)
    lab.reset()
    lab.set_policy(spec.routing)
    warm_up(lab.replicas(), lab.replica_headers())
    meta = RunMeta(
        run_id=run_id, policy=spec.label, seed=seed, simulated=False,
        profile=dataclasses.asdict(profile), routing=spec.routing,
        replicas_start=start_replicas, started_at=utc_now(), scale_at_s=scale_at,
        versions=versions(), extra={"gateway": lab.gateway_url, "new_connections": new_connections},
    )  # fmt: skip
    write_run_metadata(meta, run_dir)
    command = _locust_command(lab, profile, profile_path, spec, seed, run_id, run_dir, new_connections)
    drills = _drills(lab, start_replicas, scale_at, kill, roll)
    started = time.monotonic()
    with (run_dir / "locust.log").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            for drill in drills:
                drill.start()
            while not _finished(process, PROGRESS_EVERY_S):
                say(f"{run_id}: {_journal_rows(run_dir)}/{expected} requests, "
                    f"{time.monotonic() - started:.0f} s")  # fmt: skip
        except KeyboardInterrupt:
            _stop(process)
            meta.status = "interrupted"
            _close(meta, run_dir, drills, lab)
            raise ExperimentInterrupted(run_dir) from None
    meta.status = "finished" if process.returncode == 0 else "failed"
    _close(meta, run_dir, drills, lab)
    say(f"{run_id}: {meta.rows}/{expected} requests recorded in {time.monotonic() - started:.0f} s")
    for line in tier_lines(meta):
        say(f"{run_id}: {line}")
    if meta.rows == 0:
        raise LabError(f"{run_id}: Locust recorded no request; see {run_dir / 'locust.log'}")



def _locust_command(
    lab: Lab, profile: Profile, profile_path: Path, spec: PolicySpec, seed: int, run_id: str, run_dir: Path,
    new_connections: bool,
) -> list[str]:
    """Locust sending the profile's conversations to the gateway, recording each request in run_dir."""
    return [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "-u", str(profile.concurrency), "-r", str(profile.spawn_rate),
        "--host", lab.gateway_url, "-t", f"{int(profile.max_duration_s)}s",
        "--exit-code-on-error", "0", "--only-summary", "--loglevel", "WARNING",
        "--traffic-profile", str(profile_path), "--conversation-seed", str(seed),
        "--policy-label", spec.label, "--run-id", run_id, "--records-dir", str(run_dir),
        "--session", session_tag(run_id, time.time()),
        "--model", served_model(lab.gateway_url),
        *(["--new-connections"] if new_connections else []),
    ]  # fmt: skip


def _drills(
    lab: Lab, start_replicas: int, scale_at: float | None, kill: Kill | None, roll: Roll | None
) -> list[_Drill]:
    """What happens to the lab during the run: a scale-up, a rolling restart, a part killed."""
    drills: list[_Drill] = []
    if scale_at:
        drills.append(_Scaler(lab, start_replicas + 1, scale_at))
    if roll is not None:
        drills.append(_Roller(lab, roll))
    if kill is not None and isinstance(lab, GatewayTier):
        drills.append(Killer(lab, STORE if kill.part == "store" else list(lab.routers())[-1], kill))
    return drills

def _finished(process: subprocess.Popen, wait_s: float) -> bool:
    try:
        process.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def _journal_rows(run_dir: Path) -> int:
    journal = run_dir / JOURNAL_FILE
    return sum(1 for _ in journal.open()) if journal.exists() else 0


def _stop(process: subprocess.Popen) -> None:
    # SIGTERM lets Locust stop its users and write the parquet; kill only if it hangs.
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def served_model(gateway_url: str) -> str:
    """The model the requests name: the first the gateway lists (it refuses one it does not serve)."""
    try:
        listed = httpx.get(f"{gateway_url}/v1/models", timeout=10).json()["data"]
        return str(listed[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise LabError(f"{gateway_url}/v1/models: no model listed ({exc})") from None


def _close(meta: RunMeta, run_dir: Path, drills: Sequence[_Drill], lab: Lab) -> None:
    for drill in drills:
        drill.join()
        drill.record(meta)
    meta.rows = finalise_run_records(run_dir)
    if isinstance(lab, GatewayTier):
        meta.extra["routers_after"] = settled(lab)
        if "kill" in meta.extra:
            meta.extra["kill"] |= failures(run_dir, meta.extra["kill"].get("killed_at"))
    meta.finished_at = utc_now()
    write_run_metadata(meta, run_dir)


def settled(lab: GatewayTier, timeout: float = SETTLE_S) -> dict[str, dict[str, int]]:
    """Every router's state once none holds anything in flight, or as it is after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        states = lab.router_states()
        if all(s["in_flight_requests"] == 0 for s in states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(0.05)


def failures(run_dir: Path, killed_at: float | None) -> dict[str, int]:
    """Failed requests of the run, and how many of them were in flight at the kill (started
    before it, ended after it) or started after it."""
    rows = read_records(run_dir / REQUESTS_FILE).select(["status", "error", "started_at", "finished_at"])
    failed = [(r["started_at"].timestamp(), r["finished_at"].timestamp())
              for r in rows.to_pylist() if r["status"] != 200 or r["error"] is not None]
    counts = {"failed": len(failed)}
    if killed_at is not None:
        counts["failed_in_flight_at_kill"] = sum(start <= killed_at <= end for start, end in failed)
        counts["failed_started_after_kill"] = sum(start > killed_at for start, _ in failed)
    return counts


def tier_lines(meta: RunMeta) -> list[str]:
    """What a run of several gateways went through, for the console."""
    lines = []
    kill = meta.extra.get("kill")
    if kill:
        if kill.get("killed_at") is None:
            lines.append(f"{kill['name']} was not killed: {kill.get('error') or 'the run ended first'}")
        else:
            back = f"back after {kill['down_s']:.1f} s" if "down_s" in kill else f"not restarted: {kill.get('error')}"
            lines.append(
                f"{kill['name']} SIGKILLed at {kill['killed_after_s']:.1f} s, {back}; failed requests "
                f"{kill['failed']} ({kill['failed_in_flight_at_kill']} in flight at the kill, "
                f"{kill['failed_started_after_kill']} started after it)"
            )
    after = meta.extra.get("routers_after")
    if after:
        lines.append("in flight after the run: " + ", ".join(
            f"{name} {s['in_flight_requests']} requests / {s['in_flight_tokens']} tokens "
            f"({s['decisions']} decisions since its start)" for name, s in after.items()))
    return lines


class _Drill(threading.Thread):
    """Something done to the lab ``delay_s`` into a run, beside the traffic; an error is
    recorded in run.json and the run goes on. join() cancels it if it has not begun."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(daemon=True)
        self.delay_s = delay_s
        self.cancelled = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        if self.cancelled.wait(self.delay_s):
            return
        try:
            self.act()
        except Exception as exc:  # recorded in run.json; the run itself goes on
            self.error = f"{type(exc).__name__}: {exc}"

    def act(self) -> None:
        raise NotImplementedError

    def record(self, meta: RunMeta) -> None:
        raise NotImplementedError

    def join(self, timeout: float | None = None) -> None:
        self.cancelled.set()
        super().join(timeout)


class _Scaler(_Drill):
    """Adds a replica ``delay_s`` into the run and notes when it was ready."""

    def __init__(self, lab: Lab, target: int, delay_s: float) -> None:
        super().__init__(delay_s)
        self.lab, self.target = lab, target
        self.ready_at: str | None = None

    def act(self) -> None:
        self.lab.scale(self.target)
        self.ready_at = datetime.now(UTC).isoformat()

    def record(self, meta: RunMeta) -> None:
        meta.scaled_to, meta.scale_ready_at = self.target, self.ready_at
        if self.error:
            meta.extra["scale_error"] = self.error


@dataclasses.dataclass(frozen=True)
class Roll:
    at_s: float
    migrate: bool | None  # None: the stack's [migration] enabled
    scale_in: bool = False  # the last replica leaves for good (a scale-in by one), none restarts


class _Roller(_Drill):
    """From ``roll.at_s`` into the run, restarts every replica one at a time, as a rolling
    update does (or, ``roll.scale_in``, removes the last one), and notes each one's out,
    drained, down and up times (run.json, extra.roll)."""

    def __init__(self, lab: Any, roll: Roll) -> None:  # a lab with roll() (the local stack's)
        super().__init__(roll.at_s)
        self.lab, self.roll = lab, roll
        self.steps: list[dict[str, Any]] = []

    def act(self) -> None:
        if self.roll.scale_in:
            self.steps = self.lab.scale_in(len(self.lab.replicas()) - 1, self.roll.migrate)
            return
        for name in sorted(self.lab.replicas()):
            if self.cancelled.is_set():
                return
            self.steps.append(self.lab.roll(name, self.roll.migrate))

    def record(self, meta: RunMeta) -> None:
        meta.extra["roll"] = {**dataclasses.asdict(self.roll), "replicas": self.steps}
        if self.error:
            meta.extra["roll"]["error"] = self.error


class Killer(_Drill):
    """SIGKILLs one part of the lab (a gateway, or the store: ``name``) ``kill.at_s`` into the
    run and starts it again ``kill.restart_after_s`` later, or at once when the run ends first."""

    def __init__(self, lab: GatewayTier, name: str, kill: Kill) -> None:
        super().__init__(kill.at_s)
        self.lab, self.name, self.kill = lab, name, kill
        self.began = time.time()  # wall clock, as the records' started_at
        self.killed_at: float | None = None
        self.back_at: float | None = None

    def act(self) -> None:
        self.killed_at = self.lab.kill_part(self.name)
        self.cancelled.wait(self.kill.restart_after_s)  # the run's end cuts the wait short
        self.lab.restart_part(self.name)
        self.back_at = time.time()

    def record(self, meta: RunMeta) -> None:
        found: dict[str, Any] = {"name": self.name, **dataclasses.asdict(self.kill), "killed_at": self.killed_at}
        if self.killed_at is not None:
            found["killed_after_s"] = self.killed_at - self.began
            if self.back_at is not None:
                found["down_s"] = self.back_at - self.killed_at
        if self.error:
            found["error"] = self.error
        meta.extra["kill"] = found


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in ("llm-ring", "locust", "xllamacpp", "duckdb", "pyarrow"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=LOCUSTFILE.parent,
                                capture_output=True, text=True, timeout=5)  # fmt: skip
        if commit.returncode == 0:
            found["git"] = commit.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return found


# --- the command -------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", required=True, help="traffic profile: name (quick, standard) or JSON path")
    parser.add_argument("--policies", nargs="+", required=True, metavar="POLICY",
                        help=f"{', '.join(POLICIES)}; knobs as name:key=value,key=value")  # fmt: skip
    parser.add_argument("--seeds", nargs="+", required=True, metavar="SEED", help="integers or ranges like 1-5")
    parser.add_argument("--scale-at", type=float, default=None, metavar="S",
                        help="add one replica S seconds into every run (default: no scale-up)")  # fmt: skip
    parser.add_argument("--kill-gateway", type=float, default=None, metavar="S",
                        help="SIGKILL the last gateway S seconds into every run (a stack with --gateways 2 or more)")
    parser.add_argument("--kill-store", type=float, default=None, metavar="S",
                        help="SIGKILL the gateways' store (redis-server) S seconds into every run")
    parser.add_argument("--restart-after", type=float, default=5.0, metavar="S",
                        help="with --kill-gateway or --kill-store: start it again S seconds after the kill (default 5)")
    parser.add_argument("--roll-at", type=float, default=None, metavar="S",
                        help="restart every replica one at a time from S seconds into every run (drain, migrate, "
                             "stop, start, ready)")
    parser.add_argument("--scale-in-at", type=float, default=None, metavar="S",
                        help="remove the last replica S seconds into every run (drain, migrate, stop); "
                             "each run starts with the replicas there were")
    parser.add_argument("--migrate", action=argparse.BooleanOptionalAction, default=None,
                        help="with --roll-at or --scale-in-at: move the caches of a leaving replica (default: the "
                             "stack's [migration] enabled)")
    parser.add_argument("--new-connections", action="store_true",
                        help="every request on a connection of its own, as a CLI run once a turn opens one "
                             "(behind several gateways, consecutive turns then meet different ones)")
    parser.add_argument("--out-dir", type=Path, required=True, help="new folder for this experiment")
    parser.add_argument("--gateway", default=None, metavar="URL",
                        help="a gateway elsewhere (needs --admin); default: the local stack")  # fmt: skip
    parser.add_argument("--admin", default=None, metavar="HOST:PORT",
                        help="admin gRPC address of that gateway's routing service")  # fmt: skip
    parser.add_argument("--run-dir", default=None,
                        help="the local stack's run dir (as given to llm-ring up; $LLM_RING_RUN)")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    try:
        profile = load_traffic_profile(args.profile)
        for policy in args.policies:  # input errors before touching any lab
            parse_policy(policy)
        seeds = parse_seeds(args.seeds)
        new_folder(args.out_dir)
        kill = _kill_option(args)
        lab = connect_lab(args.gateway, args.admin, args.run_dir)
        roll = _roll_option(args)
        out = run_experiment(lab, profile, args.policies, seeds, args.out_dir, args.scale_at, kill=kill, roll=roll,
                             new_connections=args.new_connections)
    except (ProfileError, LabError) as exc:  # bad input or no lab: one line, exit 2
        raise UsageError(str(exc)) from None
    except ExperimentInterrupted as exc:
        print(f"llm-ring run: {exc}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("llm-ring run: interrupted", file=sys.stderr)
        return 130
    from extproc.analysis.report import SUMMARY_FILE, build_report, pictures_hint, render_markdown, render_table

    report = build_report(out)
    (out / SUMMARY_FILE).write_text(render_markdown(report, with_runs=True))
    print(render_table(report), end="")
    for run in sorted(p for p in out.iterdir() if p.is_dir()):
        for line in tier_lines(read_run_metadata(run)):
            print(f"{run.name}: {line}")
    print(pictures_hint(out), file=sys.stderr)
    return 0


def _roll_option(args: argparse.Namespace) -> Roll | None:
    if args.roll_at is not None and args.scale_in_at is not None:
        raise ExperimentError("--roll-at and --scale-in-at: one drill a run")
    if args.scale_in_at is not None:
        return Roll(args.scale_in_at, args.migrate, scale_in=True)
    return Roll(args.roll_at, args.migrate) if args.roll_at is not None else None


def _kill_option(args: argparse.Namespace) -> Kill | None:
    if args.kill_gateway is not None and args.kill_store is not None:
        raise ExperimentError("--kill-gateway and --kill-store: one drill a run")
    if args.kill_store is not None:
        return Kill(args.kill_store, args.restart_after, "store")
    return Kill(args.kill_gateway, args.restart_after) if args.kill_gateway is not None else None


def connect_lab(gateway: str | None, admin: str | None, run_dir: str | None = None) -> Lab:
    if gateway is not None:
        if admin is None:
            raise ExperimentError("--gateway needs --admin (to switch policies and reset the router)")
        return RemoteLab(gateway, admin)
    try:
        from extproc.stack.errors import StackError
        from extproc.stack.lab import LocalLab
    except ImportError as exc:
        raise LabError(f"the local stack is not available ({exc}); give --gateway and --admin") from None
    try:
        return LocalLab.attach(run_dir, progress=lambda text: print(text, file=sys.stderr, flush=True))
    except StackError as exc:
        raise LabError(str(exc)) from None
