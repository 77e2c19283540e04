"""Live harness of the gateway tests: real Envoy, real `llm-ring serve`, stub or llama.cpp upstreams."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from extproc.migration.llama import key_headers
from extproc.routing import Router, RouteRequest
from extproc.service.admin_client import AdminClient
from extproc.service.dataplanes.own_envoy_config import flow_options
from extproc.service.dataplanes.picker_gateways import AI_GATEWAY, UPSTREAM_HEADER
from extproc.settings import load_settings
from extproc.stack import models
from extproc.stack import replicas as stack_replicas
from extproc.stack.daemons import stop
from extproc.stack.processes import (
    ROUTER_REFERENCE,
    Running,
    free_port,
    service_env,
    start_gateway_envoy,
    start_inference_gateway_envoy,
    start_picker_service,
    start_service,
    static_discovery,
)

OPENAI_ERROR_TYPES = ("invalid_request_error", "rate_limit_error", "server_error")


def ring_home(conversation: str, replicas: Sequence[str]) -> str:
    """Where the service's policy sends a new conversation on an idle fleet (the core decides)."""
    routing = load_settings(ROUTER_REFERENCE, environ={}).routing
    return Router(routing, replicas).route(RouteRequest("probe", conversation, 40, 8)).decision.replica


def error_message(document: Any) -> str:
    """The message of an error in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``),
    every field checked: what a client's SDK prints."""
    error = document["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] in OPENAI_ERROR_TYPES and isinstance(error["code"], str) and error["code"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    return str(error["message"])


def whole_records(log: Path) -> list[dict[str, Any]]:
    """The JSON records a running service has written whole to ``log`` (the line it is writing
    may be half there)."""
    text = log.read_text()
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line.startswith("{")]


def route_decisions(log: Path) -> list[dict[str, Any]]:
    return [record for record in whole_records(log) if record.get("event") == "route_decision"]


@dataclass
class Gateway:
    url: str
    admin: str  # the service's gRPC address (Admin, health)
    log: Path  # the service's stdout: structlog JSON lines
    endpoints_file: Path
    running: list[Running] = field(default_factory=list)
    # an InferencePool data plane: no x-routed-to; the upstream address (x-upstream-host) names the replica
    replica_of: dict[str, str] = field(default_factory=dict)
    metrics: str = ""  # the service's /metrics URL

    def metric(self, name: str, **labels: str) -> float:
        """A sample of the service's /metrics (0 when absent)."""
        wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
        for line in httpx.get(self.metrics, timeout=5).text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def routed_to(self, reply: httpx.Response) -> str:
        """The replica that answered (empty: none)."""
        if self.replica_of:
            return self.replica_of.get(reply.headers.get(UPSTREAM_HEADER, ""), "")
        return reply.headers.get("x-routed-to", "")

    def decisions(self) -> list[dict[str, Any]]:
        return route_decisions(self.log)

    def state(self) -> dict[str, Any]:
        with AdminClient(self.admin) as admin:
            return admin.state()

    def wait_for_models(self, timeout: float = 10.0) -> list[str]:
        """The ids GET /v1/models lists once the service has heard from a replica (it asks each
        replica as it appears)."""
        deadline = time.monotonic() + timeout
        while not (listed := [m["id"] for m in httpx.get(self.url + "/v1/models", timeout=10).json()["data"]]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no model listed after {timeout}s")
            time.sleep(0.2)
        return listed

    def decisions_after(self, seen: int, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        """The ``count`` decisions logged after the first ``seen`` (a request is logged once over)."""
        deadline = time.monotonic() + timeout
        while len(logged := self.decisions()[seen:]) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(logged)} of {count} decisions logged after {timeout}s")
            time.sleep(0.05)
        return logged

    def wait_idle(self, timeout: float = 5.0) -> dict[str, Any]:
        """The state once nothing is in flight (or the last state seen at the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state()
            if state["in_flight_requests"] == 0 or time.monotonic() > deadline:
                return state
            time.sleep(0.05)


def flow_env(slots: str | None = None, **flow: str) -> dict[str, str]:
    """[flow] settings as LLM_RING__FLOW__ variables (TOML values), flow control on; slots: the
    room a replica has (routing.replicas.slots)."""
    env = {f"LLM_RING__FLOW__{key.upper()}": value for key, value in {"enabled": "true", **flow}.items()}
    return env | ({"LLM_RING__ROUTING__REPLICAS__SLOTS": slots} if slots is not None else {})


@contextmanager
def gateway(
    workdir: Path, discovery: Mapping[str, str], fail_open: bool = True, envoy_idle_timeout_s: int | None = None,
    replica_key_file: Path | None = None, cors_origins: Sequence[str] = (), flow: Mapping[str, str] | None = None,
    **service: str,
) -> Iterator[Gateway]:
    """`llm-ring serve` + Envoy rendered by render_envoy_config (replica_key_file: the key
    Envoy adds to the generations and the service asks for the models with, None: none;
    cors_origins: service.cors_origins of both; flow: [flow] values, flow control on: flow_env);
    everything stopped on exit."""
    endpoints_file = workdir / "eds" / "replicas.json"
    listen = f"127.0.0.1:{free_port()}"
    started: list[Running] = []
    try:
        settings = {"health_probe_seconds": "0.2", "log_level": '"debug"', **service}
        if replica_key_file is not None:
            settings.setdefault("replica_api_key_file", f'"{replica_key_file}"')
        if cors_origins:
            settings["cors_origins"] = json.dumps(list(cors_origins))
        env = service_env(listen, endpoints_file, discovery, **settings)
        env |= flow_env(**flow) if flow is not None else {}
        started.append(start_service(workdir / "service", env))
        _wait_for(endpoints_file.exists, 5.0)
        idle = {"stream_idle_timeout_s": envoy_idle_timeout_s} if envoy_idle_timeout_s else {}
        envoy = start_gateway_envoy(workdir / "envoy", started[0].ext_proc, endpoints_file, fail_open, 1, **idle,
                                    replica_key_file=replica_key_file, cors_origins=cors_origins,
                                    flow=flow_options(load_settings(ROUTER_REFERENCE, environ=env).flow))
        started.append(envoy)
        metrics = "http://" + env["LLM_RING__SERVICE__METRICS_LISTEN"].strip('"') + "/metrics"
        gw = Gateway(f"http://{envoy.listen}", started[0].address, started[0].log_path, endpoints_file, started,
                     metrics=metrics)
        _wait_for(lambda: _has_endpoints(envoy.address), 5.0)
        yield gw
    finally:
        for running in reversed(started):
            running.stop()


@contextmanager
def inference_pool_gateway(workdir: Path, replicas: Mapping[str, str], body_mode: str = "duplex",
                           flow: Mapping[str, str] | None = None, **service: str) -> Iterator[Gateway]:
    """`llm-ring serve` as a TLS Endpoint Picker behind Envoy AI Gateway's InferencePool data
    plane (full duplex, or buffered), the upstream shown in x-upstream-host (flow: [flow] values,
    flow control on); everything stopped on exit."""
    more = flow_env(**flow) if flow is not None else None
    picker = start_picker_service(workdir / "picker", replicas, health_probe_seconds="0.2", more=more, **service)
    try:
        envoy = start_inference_gateway_envoy(workdir / "envoy", AI_GATEWAY, picker.ext_proc, sorted(replicas.values()),
                                              1, show_upstream=True, body_mode=body_mode)
    except BaseException:
        picker.stop()
        raise
    try:
        yield Gateway(f"http://{envoy.listen}", picker.address, picker.log_path, Path(), [picker, envoy],
                      {address: name for name, address in replicas.items()}, f"http://{picker.listen}/metrics")
    finally:
        envoy.stop()
        picker.stop()


def back_to_back(url: str, conversation: int, stream: bool, with_header: bool,
                 new_connections: bool = False, session_header: str = "x-conversation-id") -> list[dict[str, Any]]:
    """One conversation of 4 turns sent back to back (each the instant the last answer is
    in, as an agent loop does) to the gateway at `url`: per turn the replica, reason and
    llama.cpp's timings. with_header: the conversation named ``b2b-<stream>-<conversation>`` in
    ``session_header`` (an agent client's session header, or x-conversation-id with x-turn).
    new_connections: every request on a connection of its own (behind a front that spreads
    connections, consecutive turns meet different gateways)."""
    history: list[dict[str, Any]] = [
        {"role": "system", "content": f"You are assistant number {conversation}. Answer briefly."},
    ]
    turns = []
    with httpx.Client(timeout=60) as shared:
        for turn in range(1, 5):
            history.append({"role": "user", "content": f"Question {turn} of chat {conversation}: name a colour."})
            body = {"messages": history, "max_tokens": 6, "ignore_eos": True, "stream": stream}
            headers = {session_header: f"b2b-{stream}-{conversation}", "x-turn": str(turn)} if with_header else {}
            if new_connections:
                with httpx.Client(timeout=60) as own:
                    answer, seen = _turn(own, url, body, headers, stream)
            else:
                answer, seen = _turn(shared, url, body, headers, stream)
            turns.append(seen)
            history.append({"role": "assistant", "content": answer})
    return turns


def _turn(client: httpx.Client, url: str, body: dict[str, Any], headers: dict[str, str],
          stream: bool) -> tuple[str, dict[str, Any]]:
    answer, timings = "", {}
    with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as reply:
        assert reply.status_code == 200, (reply.read(), dict(reply.headers))
        if stream:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    answer += (event["choices"][0].get("delta") or {}).get("content") or ""
                    timings = event.get("timings") or timings
        else:
            data = json.loads(reply.read())
            answer, timings = data["choices"][0]["message"]["content"], data["timings"]
        return answer, {"replica": reply.headers["x-routed-to"], "reason": reply.headers["x-route-reason"], **timings}


def assert_sdk_turns_stay_on_one_cache(base_url: str, replica_of: Any) -> None:
    """Three turns through the `openai` SDK with no custom header: every turn on one replica
    (``replica_of(response headers)``), each finding more of its history cached."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "Say something about rivers."}]
    replicas, cached = [], []
    for _ in range(3):
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2", messages=messages, max_tokens=6, extra_body={"ignore_eos": True}
        )
        completion = raw.parse()
        replicas.append(replica_of(raw.headers))
        cached.append(completion.usage.prompt_tokens_details.cached_tokens if completion.usage else None)
        messages += [{"role": "assistant", "content": completion.choices[0].message.content},
                     {"role": "user", "content": "And then?"}]  # fmt: skip
    assert len(set(replicas)) == 1, replicas
    assert cached[1] and cached[2] and cached[2] > cached[1], cached


def assert_each_turn_reused_the_whole_previous_prompt(turns: list[dict[str, Any]]) -> None:
    """Every follow-up on the first turn's replica, finding all of the last prompt cached there."""
    for previous, turn in zip(turns, turns[1:], strict=False):
        assert turn["replica"] == turns[0]["replica"], turns
        assert turn["cache_n"] >= previous["cache_n"] + previous["prompt_n"], turns


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def post(url: str, body: Any, headers: Mapping[str, str] | None = None, timeout: float = 30.0) -> httpx.Response:
    return httpx.post(url, json=body, headers=dict(headers or {}), timeout=timeout)


def accepts(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _has_endpoints(admin: str) -> bool:
    try:
        text = httpx.get(f"http://{admin}/clusters", timeout=1.0).text
    except httpx.HTTPError:
        return False
    return "replicas::" in text and "::cx_active::" in text


def _wait_for(condition: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met after {timeout}s")
        time.sleep(0.05)


@dataclass(frozen=True)
class LlamaReplicas:
    """Real llama.cpp replicas, started as the local stack starts them."""

    addresses: dict[str, str]  # name -> host:port
    key_file: Path  # the API key they want (their --api-key-file)

    @property
    def headers(self) -> dict[str, str]:
        """What a request straight to a replica carries: the key."""
        return key_headers(self.key_file.read_text().strip())


@contextmanager
def llama_replicas(run: Path, count: int = 2, model: str = "smollm2", cache_ram_mib: int = 0,
                   lora: Sequence[str] = ()) -> Iterator[LlamaReplicas]:
    """``count`` real llama.cpp replicas llm-0 ... (2 slots; a prompt cache in RAM of
    ``cache_ram_mib``, none by default) serving ``model`` under its name: "smollm2" (SmolLM2-135M)
    or "tiny" (the generated tiny model, prepared once in the data dir), each loading the LoRA
    adapters ``lora`` (names from models.MODELS, prepared once)."""
    if model == "smollm2":
        path = str(models.smollm2_gguf())
    else:
        path = models.prepare(model, models.data_dir(), progress=lambda _: None).path
    adapters = tuple(models.prepare(name, models.data_dir(), progress=lambda _: None).path for name in lora)
    settings = stack_replicas.ReplicaSettings(
        backend="xllamacpp", model=path, ctx_size=2048, parallel=2, threads=1, cache_ram_mib=cache_ram_mib, alias=model,
        lora=adapters,
    )
    started = stack_replicas.start({f"llm-{index}": free_port() for index in range(count)}, settings, run)
    try:
        stack_replicas.wait_healthy(started, timeout=120, progress=lambda _: None)
        yield LlamaReplicas({replica.name: replica.address for replica in started}, stack_replicas.api_key_file(run))
    finally:
        stop([replica.process for replica in started])


PLANES = ("own-envoy", "ai-gateway-duplex", "ai-gateway-buffered")


@contextmanager
def data_plane(name: str, workdir: Path, replicas: LlamaReplicas, cors_origins: Sequence[str] = (),
               **service: str) -> Iterator[Gateway]:
    """The gateway in front of ``replicas`` as one of PLANES: our own Envoy, or Envoy AI Gateway's
    InferencePool plane (full-duplex or buffered bodies) with the service as its picker; each
    sends the replicas' key. ``service``: more service settings (TOML values)."""
    if name == "own-envoy":
        with gateway(workdir, static_discovery(replicas.addresses), replica_key_file=replicas.key_file,
                     cors_origins=cors_origins, **service) as gw:
            yield gw
        return
    with inference_pool_gateway(workdir, replicas.addresses, body_mode=name.rpartition("-")[2],
                                replica_api_key_file=f'"{replicas.key_file}"', log_level='"debug"',
                                cors_origins=json.dumps(cors_origins), **service) as gw:
        yield gw
