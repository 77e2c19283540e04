"""What the gateway reads from HTTP bodies: pure functions, no I/O.

Requests: an OpenAI chat body (``messages``, ``max_tokens``/``max_completion_tokens``) or a
llama.cpp/OpenAI completion body (``prompt``, ``n_predict``/``max_tokens``) becomes the
conversation key, the prompt's character count and the requested output size.

Conversation key without a session id (sessions.py: a session header, or a body field such as
``prompt_cache_key``, read here when asked for): a hash of the conversation's *opening*, which
every later turn resends unchanged:
  - chat: every message up to and including the first ``user`` message (system prompt +
    first question), role and text;
  - completion: the first OPENING_CHARS characters of the prompt (token-id prompts: the
    first OPENING_CHARS ids).
Two conversations with the same opening share a key (and so a replica): usually right for
the cache, and the bounded-load cap keeps it from overloading one replica.

History of a chat body (what lets the gateway know that an earlier request was answered,
see gateway.py): ``history`` is a hash over every message (role and text) in order;
``answered`` holds that same hash taken over each leading run of messages that is followed
by an ``assistant`` message. A request whose ``answered`` contains an earlier request's
``history`` resends that request's messages plus its answer: the client has the answer.
Parallel requests on one prefix (an agent's fan-out) carry no answer of each other, so none
of them counts as answered by another.

Prefix blocks (only for policies that need them, ``request_blocks``): the prompt rendered as
one text, each chat message as ``role NUL text NUL`` in order (token-id prompts as ``id,``
per id), cut into chained block hashes by ``extproc.routing.blocks.prefix_blocks``, seeded
with the body's ``model`` and LoRA adapters (``scope``: two models' equal prompts share no
block, nor one model's under two adapter configurations); a later turn resends the earlier
messages unchanged, so its blocks begin with the earlier turn's.

LoRA adapters (``lora``: a list of ``{"id", "scale"}``, extproc/routing/adapters.py): normalised
as llama.cpp compares them, and part of the request's cache ``scope`` with its model.

Tokens (``counter``, extproc/routing/tokens.py): the prompt as the replica counts it (the
model's tokenizer over the chat template's rendering, or characters / chars_per_token), the
part of it up to the last assistant message (what the replica that answered holds) and the
ids of its opening; without a counter (tests, offline tools) all three are 0 / ().

Responses: llama.cpp's ``timings`` (cache_n, prompt_n, prompt_ms, predicted_n, predicted_ms)
or OpenAI's ``usage.prompt_tokens_details.cached_tokens``, from a JSON body or from the last
event of a ``text/event-stream`` body that carries them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import orjson
import xxhash

from extproc.envoy.contract import RESPONSE_METADATA
from extproc.envoy.surface import GENERATION_PATHS
from extproc.routing import adapters
from extproc.routing.blocks import BLOCK_CHARS, BlockMemory, model_seed, prefix_blocks
from extproc.routing.continuation import of_model
from extproc.routing.tokens import ChatCount, Message, TokenCounter
from extproc.service.sessions import usable_id

OPENING_CHARS = 512
NOT_COUNTED = ChatCount(0, 0, ())  # no counter given
CHAT_PATHS = frozenset(path for path, kind in GENERATION_PATHS.items() if kind == "chat")
# every field that sets how many tokens an answer may have, per kind (llama.cpp reads n_predict in both)
OUTPUT_FIELDS = {
    "chat": ("max_tokens", "max_completion_tokens", "n_predict"),
    "completion": ("n_predict", "max_tokens"),
}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    opening_key: str  # conversation key derived from the body (used without a session id)
    prompt_chars: int
    prompt_token_ids: int  # > 0 when the prompt was given as token ids (no estimate needed)
    max_tokens: int | None  # None: the client did not say (per prompt: times ``prompts`` charged)
    stream: bool
    history: int = 0  # hash of all messages (chat); 0 for completion bodies
    answered: frozenset[int] = frozenset()  # histories this body shows answered (see above)
    prefix_blocks: tuple[int, ...] = ()  # only when asked for (parse_request(block_chars=...))
    prompt_tokens: int = 0  # counted by parse_request's counter (0: none given)
    answered_tokens: int = 0  # chat: the prompt's tokens up to the end of the last assistant message
    opening: tuple[int, ...] = ()  # chat: the token ids of the prompt's opening (tokens.OPENING_TOKENS)
    model: str = ""  # the body's "model", "" when it names none
    prompts: int = 1  # completion: the prompts of a list, each answered (and charged) on its own
    sessions: tuple[tuple[str, str], ...] = ()  # (field, id) of the session fields asked for that it carries
    lora: str = ""  # its LoRA adapter configuration, normalised (routing/adapters.py: label); "": the server's own

    @property
    def scope(self) -> str:
        """Where its cache lives: its model under its adapter configuration (adapters.scope)."""
        return adapters.scope(self.model, self.lora)


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """The work one request may ask for (service.max_messages, max_prompt_chars, max_output_tokens)."""

    max_messages: int
    max_prompt_chars: int  # token-id prompts: at most this many ids
    max_output_tokens: int  # one slot's context: a larger max_tokens / n_predict, or -1, is charged as this


class BadRequest(ValueError):
    """The body cannot be routed: the HTTP ``status`` the client gets, and OpenAI's error ``code``
    and ``param`` (the field at fault)."""

    def __init__(self, status: int, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def __reduce__(self) -> tuple[type[BadRequest], tuple[int, str, str, str | None]]:  # crosses processes (offload.py)
        return BadRequest, (self.status, self.message, self.code, self.param)


@dataclass(frozen=True, slots=True)
class Timings:
    cache_n: int | None = None
    prompt_n: int | None = None
    prompt_ms: float | None = None
    predicted_n: int | None = None
    predicted_ms: float | None = None

    def as_dict(self) -> dict[str, Any]:
        named = (("cache_n", self.cache_n), ("prompt_n", self.prompt_n), ("prompt_ms", self.prompt_ms),
                 ("predicted_n", self.predicted_n), ("predicted_ms", self.predicted_ms))
        return {name: value for name, value in named if value is not None}


def parse_request(
    path: str, content_type: str, body: bytes, limits: BodyLimits | None = None, block_chars: int = 0,
    memory: BlockMemory | None = None, counter: TokenCounter | None = None, session_fields: tuple[str, ...] = (),
) -> ParsedRequest:
    """Read a request body, or raise BadRequest(status, message) saying what is wrong.
    limits: the service's; None (tests, offline tools) checks types only.
    block_chars: also cut the prompt into prefix blocks of that many characters (for the
    policies that need them; 0: no blocks), with ``memory`` (of that block size) hashing only
    what the conversation's last prompt did not hold.
    counter: count the prompt's tokens with it (the module docstring).
    session_fields: the top-level fields that may name the conversation (service.session_ids)."""
    if not body:
        raise BadRequest(400, "empty body: expected a JSON object", "empty_body")
    media = content_type.partition(";")[0].strip().lower()
    if media and media != "application/json":
        raise BadRequest(415, f"content-type {media[:80]!r} is not supported: send application/json",
                         "unsupported_media_type")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(400, f"body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequest(400, f"body must be a JSON object, got {type(data).__name__}", "invalid_json")
    kind = GENERATION_PATHS.get(path)
    if kind is None:
        raise BadRequest(404, f"unknown path {path[:80]!r}", "unknown_path")
    stream = data.get("stream") is True
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(400, "'model' must be a string", "invalid_type", "model")
    max_tokens = _max_tokens(data, limits, OUTPUT_FIELDS[kind])
    lora = _lora(data.get("lora"))
    sessions = tuple((name, found) for name in session_fields if (found := usable_id(data.get(name))))
    if kind == "chat":
        key, chars, history, answered, messages = _chat(data.get("messages"), limits)
        counted = counter.count_chat(messages) if counter is not None else NOT_COUNTED
        parsed = ParsedRequest(key, chars, 0, max_tokens, stream, history, answered, (), counted.prompt,
                               counted.answered, counted.opening, model or "", sessions=sessions, lora=lora)
    else:
        prompts = _prompts(data.get("prompt"))
        key, chars, ids = _completion(prompts, limits)
        tokens = sum(counter.count_text(p) for p in prompts if isinstance(p, str)) if counter is not None else 0
        parsed = ParsedRequest(key, chars, ids, max_tokens, stream, prompt_tokens=tokens, model=model or "",
                               prompts=len(prompts), sessions=sessions, lora=lora)
    if not block_chars:
        return parsed
    text, seed = _prompt_text(kind, data), model_seed(parsed.scope)
    if memory is not None and memory.block_chars == block_chars:
        # a conversation's blocks live under its model and adapters, as the conversation itself does
        return replace(parsed, prefix_blocks=memory.blocks(of_model(parsed.scope, parsed.opening_key), text, seed))
    return replace(parsed, prefix_blocks=prefix_blocks(text, block_chars, seed))


def too_many_messages(body: bytes, limits: BodyLimits) -> BadRequest | None:
    """A refusal for a chat body with far more messages than allowed, found without parsing it
    (parsing 90,000 messages costs ~50 ms of CPU even when the answer is 413). A bare ``"`` never
    occurs inside a JSON string, so each ``"role"`` in the bytes is a string token of its own:
    more of them than 2 x max_messages means more messages than allowed (short of thousands of
    strings that are "role" elsewhere in the body). Escaped keys are still caught by parsing."""
    count = body.count(b'"role"')
    if count > 2 * limits.max_messages:
        return _over("'messages'", count, "messages or more", limits.max_messages, "max_messages")
    return None


def _chat(messages: Any, limits: BodyLimits | None) -> tuple[str, int, int, frozenset[int], list[Message]]:
    """(opening key, characters, history, answered, (role, text) of each message): see the module docstring."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest(400, "'messages' must be a non-empty list", "invalid_type", "messages")
    if limits is not None and len(messages) > limits.max_messages:
        raise _over("'messages'", len(messages), "messages", limits.max_messages, "max_messages")
    max_chars = limits.max_prompt_chars if limits is not None else None
    opening_hasher = history_hasher = xxhash.xxh64()
    answered: list[int] = []
    texts: list[Message] = []
    chars = 0
    opening = True
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(400, f"messages[{index}] must be an object", "invalid_type", f"messages[{index}]")
        role = message.get("role")
        if not isinstance(role, str):
            raise BadRequest(400, f"messages[{index}].role must be a string", "invalid_type", f"messages[{index}].role")
        text = _text(message.get("content"), f"messages[{index}].content")
        texts.append((role, text))
        chars += len(text)
        if max_chars is not None and chars > max_chars:
            raise _over("the messages", chars, "characters", max_chars, "max_prompt_chars")
        if role == "assistant" and index:
            answered.append(history_hasher.intdigest())
        piece = f"{role}\x00{text}\x00".encode()
        if opening:
            opening_hasher.update(piece)
            opening = role != "user"
            if not opening:  # from here on the history hash goes on alone
                history_hasher = opening_hasher.copy()
        else:
            history_hasher.update(piece)
    opening_key = "h:" + opening_hasher.hexdigest()
    return opening_key, chars, history_hasher.intdigest(), frozenset(answered), texts


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text counts
        return "".join(_part_text(part, f"{where}[{index}]") for index, part in enumerate(content))
    raise BadRequest(400, f"{where} must be a string or a list of parts", "invalid_type", where)


def _part_text(part: Any, where: str) -> str:
    if not isinstance(part, dict):
        raise BadRequest(400, f"{where} must be an object", "invalid_type", where)
    text = part.get("text", "")
    if not isinstance(text, str):
        raise BadRequest(400, f"{where}.text must be a string", "invalid_type", f"{where}.text")
    return text


Prompt = str | list[int]


def _prompts(prompt: Any) -> list[Prompt]:
    """The prompts of a completion body: a string, a list of token ids, or a list of those (each
    answered on its own, as OpenAI and llama.cpp allow)."""
    if isinstance(prompt, str) and prompt or _token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) and p or _token_ids(p) for p in prompt):
        return prompt
    raise BadRequest(400, "'prompt' must be a non-empty string, a list of token ids, or a list of those",
                     "invalid_type", "prompt")


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _completion(prompts: list[Prompt], limits: BodyLimits | None) -> tuple[str, int, int]:
    """(opening key of the first prompt, characters, token ids) of a completion's prompts."""
    chars = sum(len(p) for p in prompts if isinstance(p, str))
    ids = sum(len(p) for p in prompts if isinstance(p, list))
    if limits is not None and chars + ids > limits.max_prompt_chars:
        raise _over("'prompt'", chars + ids, "characters or ids", limits.max_prompt_chars, "max_prompt_chars")
    first = prompts[0]
    opening = first[:OPENING_CHARS].encode() if isinstance(first, str) else repr(first[:OPENING_CHARS]).encode()
    return "h:" + xxhash.xxh64_hexdigest(opening), chars, ids


def request_blocks(path: str, body: bytes, block_chars: int = BLOCK_CHARS) -> tuple[int, ...]:
    """Prefix blocks of a body that ``parse_request`` accepted (() when it has no prompt text)."""
    data = orjson.loads(body)
    seed = model_seed(adapters.scope(data.get("model") or "", _lora(data.get("lora"))))
    return prefix_blocks(_prompt_text(GENERATION_PATHS[path], data), block_chars, seed)


def _lora(value: Any) -> str:
    """The label of a body's ``lora`` (routing/adapters.py): "" when absent or empty (the
    server's own adapters), else its entries normalised; BadRequest unless it is a list of
    ``{"id": integer >= 0, "scale": number}``."""
    if value is None or value == []:
        return ""
    if not isinstance(value, list):
        raise BadRequest(400, "'lora' must be a list of {\"id\": integer, \"scale\": number}", "invalid_type", "lora")
    entries = [_adapter(entry, f"lora[{index}]") for index, entry in enumerate(value)]
    try:
        return adapters.label(adapters.normalised(entries))
    except OverflowError:
        raise BadRequest(400, "'lora': a scale is out of a 32-bit float's range", "invalid_value", "lora") from None


def _adapter(entry: Any, where: str) -> tuple[int, float]:
    if not isinstance(entry, dict):
        raise BadRequest(400, f"{where} must be an object with \"id\" and \"scale\"", "invalid_type", where)
    adapter, scale = entry.get("id"), entry.get("scale")
    if type(adapter) is not int or not 0 <= adapter < 2**31:
        raise BadRequest(400, f"{where}.id must be an integer >= 0 (an adapter's index)", "invalid_type", f"{where}.id")
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise BadRequest(400, f"{where}.scale must be a number", "invalid_type", f"{where}.scale")
    return adapter, float(scale)


def _prompt_text(kind: str, data: dict[str, Any]) -> str:
    """The prompt as one text, as prefix blocks cut it (the module docstring); a completion's
    first prompt (its cache is the one a follow-up may find)."""
    if kind == "chat":
        return "".join(f"{message.get('role')}\x00{_text(message.get('content'), 'content')}\x00"
                       for message in data["messages"])
    prompt = _prompts(data["prompt"])[0]
    return prompt if isinstance(prompt, str) else "".join(f"{token}," for token in prompt)


UNTIL_CONTEXT_ENDS = -1  # llama.cpp's n_predict (and max_tokens) -1: generate until the context is full


def _max_tokens(data: dict[str, Any], limits: BodyLimits | None, names: tuple[str, ...]) -> int | None:
    """The most output tokens any of the fields ``names`` allows (every one is read: which one a
    replica obeys is its business), at most one slot's context (service.max_output_tokens); -1
    is that maximum. None: no field given, or -1 without limits."""
    asked: list[int] = []
    for name in names:
        value = data.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequest(400, f"'{name}' must be an integer", "invalid_type", name)
        if value <= 0 and value != UNTIL_CONTEXT_ENDS:
            raise BadRequest(400, f"'{name}' must be a positive integer, or -1 (until the context is full)",
                             "invalid_value", name)
        asked.append(value)
    if not asked:
        return None
    if limits is None:
        return None if UNTIL_CONTEXT_ENDS in asked else max(asked)
    return limits.max_output_tokens if UNTIL_CONTEXT_ENDS in asked else min(max(asked), limits.max_output_tokens)


def _over(what: str, size: int, unit: str, limit: int, setting: str) -> BadRequest:
    return BadRequest(413, f"{what}: {size} {unit}, over the limit of {limit} (service.{setting})",
                      "request_too_large")


def parse_timings(body: bytes, event_stream: bool) -> Timings | None:
    """Timings from a JSON body, or from the last event of an SSE body (or its tail) that has them."""
    if event_stream:
        for line in reversed(body.split(b"\n")):
            if line.startswith(b"data:") and (b'"timings"' in line or b'"usage"' in line):
                found = _timings_from_json(line[5:])
                if found is not None:
                    return found
        return None
    return _timings_from_json(body)


def timings_from_metadata(values: Mapping[str, float]) -> Timings | None:
    """Timings from the numbers Envoy extracted (RESPONSE_METADATA keys): the same Timings as
    parsing the body would give, read straight from the flat keys (this runs per request).
    JSON integers arrive as floats: a whole float counts as an integer."""
    if not _TIMINGS_KEYS.isdisjoint(values):
        get = values.get
        return Timings(
            cache_n=_whole(get("cache_n")),
            prompt_n=_whole(get("prompt_n")),
            prompt_ms=get("prompt_ms"),
            predicted_n=_whole(get("predicted_n")),
            predicted_ms=get("predicted_ms"),
        )
    get = values.get
    return _from_usage(_whole(get("cached_tokens")), _whole(get("prompt_tokens")), _whole(get("completion_tokens")))


_TIMINGS_KEYS = frozenset(key for key, path in RESPONSE_METADATA.items() if path[0] == "timings")


def _whole(value: float | None) -> int | None:
    return int(value) if value is not None and value.is_integer() else None


def _timings_from_json(text: bytes) -> Timings | None:
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return _timings_from_data(data)


def _timings_from_data(data: Any) -> Timings | None:
    if not isinstance(data, dict):
        return None
    timings = data.get("timings")
    if isinstance(timings, dict):
        return Timings(
            cache_n=_int(timings.get("cache_n")),
            prompt_n=_int(timings.get("prompt_n")),
            prompt_ms=_float(timings.get("prompt_ms")),
            predicted_n=_int(timings.get("predicted_n")),
            predicted_ms=_float(timings.get("predicted_ms")),
        )
    usage = data.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
        return _from_usage(cached, _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")))
    return None


def _from_usage(cached: int | None, prompt: int | None, completion: int | None) -> Timings | None:
    """OpenAI's usage: prompt_tokens counts the cached ones too; nothing to say without either."""
    if cached is None and prompt is None:
        return None
    new = prompt - cached if prompt is not None and cached is not None else None
    return Timings(cache_n=cached, prompt_n=new, predicted_n=completion)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
