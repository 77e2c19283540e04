"""Traffic profiles and the deterministic conversation generator (Locust and the simulator)."""

from extproc.traffic.generator import (
    Conversation,
    Turn,
    generate_conversation,
    generate_conversations,
)
from extproc.traffic.profile import (
    Profile,
    ProfileError,
    available_profiles,
    check_context,
    load_profile,
)

__all__ = [
    "Conversation",
    "Profile",
    "ProfileError",
    "Turn",
    "available_profiles",
    "check_context",
    "generate_conversation",
    "generate_conversations",
    "load_profile",
]
