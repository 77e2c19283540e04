"""The router's one token estimator.

The router sees text, not tokens; llama.cpp's tokenizer is not on the request path.
About four characters per token is close for English with BPE vocabularies. Every
caller goes through this function so a real tokenizer can replace it in one place.
"""

from __future__ import annotations

import math


def estimate_tokens(chars: int, chars_per_token: float) -> int:
    """Tokens in a text of ``chars`` characters (at least 1: an empty prompt still costs a step)."""
    return max(1, math.ceil(chars / chars_per_token))
