"""llm-ring: cache-aware routing for llama.cpp replicas behind Envoy ext_proc."""

__version__ = "0.1.0"
