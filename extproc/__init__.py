"""llm-ring: cache-aware routing for llama.cpp replicas behind Envoy ext_proc."""

import sys

from extproc.compiled import CoreError, install

__version__ = "0.1.0"

try:
    CORE = install()  # "compiled" or "python": how the routing core runs (extproc/compiled.py)
except CoreError as error:  # a start-up setting: one line, exit code 2
    print(f"llm-ring: {error}", file=sys.stderr)
    raise SystemExit(2) from None
