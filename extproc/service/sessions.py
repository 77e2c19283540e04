"""Where a request's conversation id comes from: an ordered list of session headers and body
fields (service.session_ids), pure, no I/O.

Agent clients name their sessions themselves: Claude Code sends ``x-claude-code-session-id``,
OpenCode ``x-session-affinity``, Codex a ``session_id`` header, an OpenAI client may set the
body's ``prompt_cache_key``, and llm-ring's own clients send ``x-conversation-id``. The first
source of the list that a request carries names its conversation; a request carrying none is
keyed by its opening (bodies.py). An id is still no capability: the gateway routes it under the
continuation rule (extproc/routing/continuation.py), whatever source it came from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

HEADER = "header:"
BODY = "body:"

Kind = Literal["header", "body"]


@dataclass(frozen=True, slots=True)
class SessionSources:
    """The sources of service.session_ids, in their order."""

    order: tuple[tuple[Kind, str], ...]

    @classmethod
    def parse(cls, entries: Sequence[str]) -> SessionSources:
        """``["header:x-session-affinity", "body:prompt_cache_key", ...]`` (settings.py checked their shape)."""
        order: list[tuple[Kind, str]] = []
        for entry in entries:
            if entry.startswith(HEADER):
                order.append(("header", entry.removeprefix(HEADER)))
            elif entry.startswith(BODY):
                order.append(("body", entry.removeprefix(BODY)))
            else:
                raise ValueError(f"{entry!r}: expected header:NAME or body:FIELD")
        return cls(tuple(order))

    @property
    def headers(self) -> tuple[str, ...]:
        """The header names to read from a request."""
        return tuple(name for kind, name in self.order if kind == "header")

    @property
    def fields(self) -> tuple[str, ...]:
        """The body fields to read from a request's JSON."""
        return tuple(name for kind, name in self.order if kind == "body")

    def pick(self, headers: Mapping[str, str], fields: Mapping[str, str]) -> str:
        """The id of the first source the request carries ("" when none): ``headers`` and
        ``fields`` hold what the request carried of this list's headers and body fields."""
        for kind, name in self.order:
            value = (headers if kind == "header" else fields).get(name)
            if value:
                return value
        return ""


def usable_id(value: object) -> str:
    """A body field's value as an id: a string of printable characters (what a header can carry),
    else "" (ignored: a control character could forge the separators of the router's keys)."""
    return value if isinstance(value, str) and value.isprintable() else ""
