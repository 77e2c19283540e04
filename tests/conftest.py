"""Suite-wide settings. Hypothesis checks properties, not speed: no per-example deadline (speed
is measured by `llm-ring bench`, and a shared 2-core machine makes any deadline flaky)."""

from hypothesis import settings

settings.register_profile("llm-ring", deadline=None)
settings.load_profile("llm-ring")
