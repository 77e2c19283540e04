"""What a llama.cpp replica is, as the routing core counts on it: ``[routing.replicas]``.

One description serves every replica of the fleet. The Router answers it for each replica
(``Router.facts``), the one place a replica's own facts (its /props, say) would be looked up:
flow control's room and the gateway's openings ask it replica by replica; a policy is built with
the fleet's (llm-aware: its predicted time to first token, its prefix index's capacity).
"""

from __future__ import annotations

from pydantic import Field

from extproc.strict import Strict


class ReplicaFacts(Strict):
    """A replica's capacity: how many requests it runs at once, how much prompt it keeps cached."""

    slots: int = Field(gt=0, le=4096, description="requests a replica runs at once (llama.cpp --parallel): "
                                                  "flow control's room and llm-aware's predicted wait")
    cache_tokens: int = Field(gt=0, description="tokens of prompts a replica keeps cached (its context plus "
                                                "--cache-ram): the prefix index's capacity, least recent "
                                                "forgotten beyond")
