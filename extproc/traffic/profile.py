"""Traffic profiles: the shape of a load test, read from a JSON file.

A profile has no defaults: every field must be present, and a missing, unknown or
wrongly typed field is reported by name. Ranges are written ``[low, high]``
(inclusive). Profiles ship in ``extproc/traffic/profiles/<name>.json``; any other
path to a JSON file works too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

PROFILES_DIR = Path(__file__).parent / "profiles"


class ProfileError(ValueError):
    """A profile is missing, unreadable or invalid; the message names the field."""


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    concurrency: int  # users = conversations in flight at once
    conversations: int  # conversations in one run (users take the next one when done)
    spawn_rate: float  # users started per second
    turns: tuple[int, int]  # user turns per conversation
    doc_share: float  # share of conversations whose first turn pastes a document
    doc_words: tuple[int, int]  # words of a pasted document
    user_words: tuple[int, int]  # words of an ordinary user message
    max_tokens: int  # answer length (sent with ignore_eos, so answers have exactly this)
    think_time_s: tuple[float, float]  # pause before each turn (before the first: staggers starts)
    system_words: tuple[int, int]  # words of a system prompt opening each conversation ([0, 0]: none)
    tool_share: float  # share of follow-up turns that send a tool result instead of a user question
    tool_words: tuple[int, int]  # words of a tool result
    fanout_share: float  # share of conversations that fan out once: parallel requests on one prefix
    fanout_requests: tuple[int, int]  # requests sent at once at the fan-out turn, that turn's own included
    max_context_tokens: int  # a conversation ends before its estimated context would exceed this
    chars_per_token: float  # the generator's token estimate (only used for max_context_tokens)
    stream: bool  # ask for SSE answers (TTFT measured) or whole JSON answers
    max_duration_s: float  # safety cap on one run's wall time


_INT_RANGES = {"turns", "doc_words", "user_words", "system_words", "tool_words", "fanout_requests"}
_FLOAT_RANGES = {"think_time_s"}
_POSITIVE_INTS = {"concurrency", "conversations", "max_tokens", "max_context_tokens"}
_POSITIVE_FLOATS = {"spawn_rate", "chars_per_token", "max_duration_s"}
_SHARES = {"doc_share", "tool_share", "fanout_share"}


def load_profile(name_or_path: str | Path) -> Profile:
    """Read a profile by name (``quick``) or by path (``my/profile.json``)."""
    path = _resolve(name_or_path)
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile {path}: not valid JSON: {exc}") from None
    return parse_profile(raw, source=str(path))


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def parse_profile(raw: Any, source: str = "profile") -> Profile:
    if not isinstance(raw, dict):
        raise ProfileError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    names = [f.name for f in fields(Profile)]
    problems = [f"{key}: missing (every field must be given)" for key in names if key not in raw]
    problems += [f"{key}: unknown field" for key in raw if key not in names]
    values: dict[str, Any] = {}
    for key in names:
        if key in raw:
            try:
                values[key] = _field(key, raw[key])
            except ProfileError as exc:
                problems.append(f"{key}: {exc}")
    if problems:
        raise ProfileError(f"{source}: invalid profile:\n  " + "\n  ".join(problems))
    profile = Profile(**values)
    _check_consistency(profile, source)
    return profile


def _resolve(name_or_path: str | Path) -> Path:
    text = str(name_or_path)
    is_path = text.endswith(".json") or "/" in text
    path = Path(text) if is_path else PROFILES_DIR / f"{text}.json"
    if not path.is_file():
        known = ", ".join(available_profiles())
        raise ProfileError(f"profile not found: {text} (known profiles: {known}; or give a path to a .json file)")
    return path


def _field(key: str, value: Any) -> Any:
    if key in _INT_RANGES:
        return _range(value, int)
    if key in _FLOAT_RANGES:
        return _range(value, float)
    if key in _POSITIVE_INTS:
        number = _number(value, int)
        if number <= 0:
            raise ProfileError(f"must be > 0 (got {value!r})")
        return number
    if key in _POSITIVE_FLOATS:
        number = _number(value, float)
        if number <= 0:
            raise ProfileError(f"must be > 0 (got {value!r})")
        return number
    if key in _SHARES:
        share = _number(value, float)
        if not 0 <= share <= 1:
            raise ProfileError(f"must be between 0 and 1 (got {value!r})")
        return share
    if key == "stream":
        if not isinstance(value, bool):
            raise ProfileError(f"must be true or false (got {value!r})")
        return value
    if not isinstance(value, str):  # name, description
        raise ProfileError(f"must be a string (got {value!r})")
    return value


def _number(value: Any, kind: type) -> Any:
    # bool is an int in Python; a profile saying `"turns": true` is a mistake.
    ok = isinstance(value, int) if kind is int else isinstance(value, int | float)
    if isinstance(value, bool) or not ok:
        raise ProfileError(f"must be {'an integer' if kind is int else 'a number'} (got {value!r})")
    return kind(value)


def _range(value: Any, kind: type) -> tuple[Any, Any]:
    if not isinstance(value, list) or len(value) != 2:
        raise ProfileError(f"must be a [low, high] pair (got {value!r})")
    low, high = (_number(v, kind) for v in value)
    if low < 0 or low > high:
        raise ProfileError(f"needs 0 <= low <= high (got {value!r})")
    return (low, high)


def _check_consistency(profile: Profile, source: str) -> None:
    if profile.turns[0] < 1:
        raise ProfileError(f"{source}: turns: a conversation needs at least 1 turn (got {list(profile.turns)})")
    if profile.user_words[0] < 1:
        raise ProfileError(f"{source}: user_words: a message needs at least 1 word")
    if profile.tool_share > 0 and profile.tool_words[0] < 1:
        raise ProfileError(f"{source}: tool_words: a tool result needs at least 1 word")
    if profile.fanout_requests[0] < 1:
        raise ProfileError(f"{source}: fanout_requests: a fan-out sends at least 1 request")
    if profile.conversations < profile.concurrency:
        raise ProfileError(
            f"{source}: conversations ({profile.conversations}) must be >= concurrency ({profile.concurrency})"
        )


def check_context(profile: Profile, slot_context_tokens: int, margin: float = 0.15) -> None:
    """Refuse a profile whose conversations may not fit in one replica slot.

    ``slot_context_tokens`` is the replicas' per-slot context (ctx_size / n_parallel).
    The generator only *estimates* tokens (characters / chars_per_token), so the
    profile's max_context_tokens must stay ``margin`` below the real limit.
    """
    limit = int(slot_context_tokens * (1 - margin))
    if profile.max_context_tokens > limit:
        raise ProfileError(
            f"profile {profile.name}: max_context_tokens={profile.max_context_tokens} exceeds "
            f"the replicas' per-slot context {slot_context_tokens} minus a {margin:.0%} margin "
            f"({limit}); lower max_context_tokens or give the replicas more context per slot"
        )
