"""llm-aware's parameters, ``[routing.llm-aware]``, and its reason codes."""

from __future__ import annotations

from typing import Annotated, NamedTuple

from pydantic import Field

from extproc.routing.policies.bounded_walk import WALK_REASONS
from extproc.routing.policies.situation import HOME_REASON

# plugin.py: the functional form keeps the constraints under mypyc
LlmAwareParams = NamedTuple("LlmAwareParams", [
    ("epsilon", Annotated[float, Field(gt=0, le=10, description="bounded loads: cap = (1 + epsilon) x average")]),
    # the three switchable additions and their knobs
    ("cache_aware", Annotated[bool, Field(description="a cached replica is charged only the new tokens")]),
    ("placement_memory", Annotated[bool, Field(description="prefer where the conversation was last served")]),
    ("long_stickiness", Annotated[bool, Field(description="long cached conversations tolerate long_load_factor")]),
    ("long_prompt_tokens", Annotated[int, Field(gt=0, description="a conversation is long from this many prompt "
                                                                  "tokens")]),
    ("long_load_factor", Annotated[float, Field(gt=1, le=100, description="long cap = factor x average")]),
    # the prefix index (docs/prefix-index.md; its capacity: routing.replicas.cache_tokens): two more
    # switchable additions
    ("prefix_index", Annotated[bool, Field(description="expected cache on each replica = its longest held prefix "
                                                       "of the prompt; over the cap a redirect must land "
                                                       "(1 + epsilon) times lower")]),
    ("prefix_feedback", Annotated[bool, Field(description="prefix index: a replica reporting whole blocks fewer "
                                                          "(more) than predicted has its capacity lowered (raised) "
                                                          "by as many tokens")]),
    # on predicted time to first token (docs/policies.md)
    ("ttft_decisions", Annotated[bool, Field(description="pick by predicted time to first token; the bounded walk "
                                                         "decides only past ttft_guard_factor x average")]),
    ("ttft_margin", Annotated[float, Field(ge=0, le=10, description="a request leaves its cached replica only "
                                                                    "where its first token is predicted this share "
                                                                    "sooner")]),
    ("ttft_recompute_cost", Annotated[bool, Field(description="a move away from the cache is also charged the "
                                                              "prefill of the tokens it computes again, the delay "
                                                              "they bring the requests queued behind it")]),
    ("ttft_guard_factor", Annotated[float, Field(gt=1, le=100, description="past this factor x average load in "
                                                                           "tokens the preferred replica goes to "
                                                                           "the bounded walk")]),
])
REASONS = {
    **HOME_REASON,
    "sticky": "llm-aware: where placement memory says the conversation's cache is, not its ring home",
    "home-long": "llm-aware: ring home above the normal cap but within the long-conversation cap",
    "sticky-long": "llm-aware: remembered replica above the normal cap but within the long cap",
    "prefix": "llm-aware, prefix index: the replica holding the longest prefix of the prompt, not its ring home",
    "prefix-long": "llm-aware, prefix index: that replica above the normal cap but within the long cap",
    "home-requests": "llm-aware, prefix index: the cached home over its limit in tokens, within the cap in requests",
    "prefix-requests": "llm-aware, prefix index: that replica over its limit in tokens, within the cap in requests",
    "least-recent": "llm-aware, prefix index: a prompt no replica holds; under the cap, the replica whose least "
                    "recent prompt is oldest",
    "faster": "llm-aware: another replica's first token predicted ttft_margin sooner than the preferred one's",
    "warm": "llm-aware: no replica holds the cache and the model is cold on the preferred one: the first replica "
            "clockwise where the model is loaded (router mode, sleep)",
    **WALK_REASONS,
    "kept": "llm-aware, prefix index: none fitted under the cap; the cached replica, none landing (1 + ε) x lower",
}
