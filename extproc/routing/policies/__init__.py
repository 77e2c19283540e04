"""The routing policies, one file each, and the registry that names them (plugin.py: what a
policy file holds; a new policy is its file and one line here).

Ours: round-robin, mod-n, consistent, bounded, llm-aware. The field's routers as
baselines (docs/peer-policies.md): prefix-affinity (llm-d), radix-balance (SGLang),
chwbl (KubeAI), kv-cost (Dynamo).
"""

from __future__ import annotations

from extproc.routing.policies import (
    bounded,
    chwbl,
    consistent,
    kv_cost,
    llm_aware,
    mod_n,
    prefix_affinity,
    radix_balance,
    round_robin,
)
from extproc.routing.policies.plugin import (
    REGISTRY,
    CacheMoves,
    CacheReports,
    Policy,
    PolicyPlugin,
    SentView,
    SharedView,
    make_policy,
    reasons,
    register,
)

register(round_robin.PLUGIN)
register(mod_n.PLUGIN)
register(consistent.PLUGIN)
register(bounded.PLUGIN)
register(llm_aware.PLUGIN)
register(prefix_affinity.PLUGIN)  # the field's routers (docs/peer-policies.md)
register(radix_balance.PLUGIN)
register(chwbl.PLUGIN)
register(kv_cost.PLUGIN)

__all__ = [
    "REGISTRY", "CacheMoves", "CacheReports", "Policy", "PolicyPlugin", "SentView", "SharedView",
    "make_policy", "reasons", "register",
]
