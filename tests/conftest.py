"""Suite-wide settings. Hypothesis checks properties, not speed: no per-example deadline (speed
is measured by `llm-ring bench`, and a shared 2-core machine makes any deadline flaky)."""

from collections.abc import Iterator

import pytest
import structlog
from hypothesis import settings

settings.register_profile("llm-ring", deadline=None)
settings.load_profile("llm-ring")


@pytest.fixture(autouse=True)
def _fresh_logging() -> Iterator[None]:
    """A test that runs a command in-process (`llm-ring serve` refusing a setting) configures
    structlog onto that test's captured stdout; later tests must not log into the closed file."""
    yield
    structlog.reset_defaults()
