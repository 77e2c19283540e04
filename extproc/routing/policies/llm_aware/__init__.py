"""llm-aware: bounded loads in tokens, plus switchable LLM-specific additions, built from parts.

- cache_aware: where the request's prefix is expected cached it costs only its new
  tokens, max(1, prompt - cached) + max_tokens; elsewhere its whole prompt. The cached
  replica, when preferred, also keeps one request of slack under the cap (bounds.py).
- placement_memory: prefer where the cache is (the conversation's last replica, or with
  the prefix index the longest held prefix) over the ring home, which would pay a
  second full prefill.
- long_stickiness: a cached conversation of at least long_prompt_tokens may load its
  replica up to long_load_factor × average before being moved: moving it costs most.
- prefix_index (docs/prefix-index.md): where the cache is comes from a bounded index of
  the prompt blocks sent to each replica (at most its cache_tokens each, least
  recently sent forgotten first), not from placement memory (index.py). Over the cap the
  cached replica keeps the request unless another replica fits under the cap or would land
  (1 + ε) times lower: a redirect pays the whole prefill again. It also takes it while within
  the cap in requests (bounds.py). A failed request's new blocks are forgotten (view.py).
  prefix_feedback: a replica that reports whole blocks fewer (more) than predicted has its
  capacity lowered (raised) by as many tokens.
- ttft_decisions: pick by predicted time to first token (prediction.py) within a guard rail
  (guard.py).

The parts: params.py (the section and the reason codes), where.py (where the cache is:
placement memory) and index.py (the prefix index), view.py (the index's upkeep, which the
Router feeds), bounds.py, prediction.py, guard.py, warm.py (the replicas where the model is
cold), trace.py (the trace, which renders itself) and policy.py (the decision). With every
addition off llm-aware decides exactly as bounded in tokens mode; with the prefix index off
exactly as the seed's llm-aware.
"""

from __future__ import annotations

from extproc.routing.policies.llm_aware.index import INDEX_BLOCK_CHARS, IndexedCache
from extproc.routing.policies.llm_aware.params import REASONS, LlmAwareParams
from extproc.routing.policies.llm_aware.policy import LlmAware
from extproc.routing.policies.llm_aware.trace import LlmAwareTrace
from extproc.routing.policies.llm_aware.view import IndexView
from extproc.routing.policies.llm_aware.where import PlacementMemoryCache
from extproc.routing.policies.plugin import PolicyPlugin
from extproc.routing.prefix_index import PrefixIndex
from extproc.routing.replica_facts import ReplicaFacts


def make_llm_aware(params: LlmAwareParams, facts: ReplicaFacts) -> LlmAware:
    """llm-aware with the cache found by placement memory, or by a prefix index it keeps up to
    date, holding each replica's cache_tokens."""
    if not params.prefix_index:
        return LlmAware(params, facts.slots, PlacementMemoryCache(), None)
    index = PrefixIndex(facts.cache_tokens)
    return LlmAware(params, facts.slots, IndexedCache(index, params.placement_memory),
                    IndexView(index, params.prefix_feedback))


PLUGIN: PolicyPlugin = PolicyPlugin("llm-aware", LlmAwareParams,
                                    lambda params, routing, facts: make_llm_aware(params, facts), REASONS)

__all__ = ["INDEX_BLOCK_CHARS", "PLUGIN", "IndexView", "LlmAware", "LlmAwareParams", "LlmAwareTrace",
           "make_llm_aware"]
