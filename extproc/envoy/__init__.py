"""Envoy's side of the gateway: the contract the routing service shares with Envoy
(contract.py: header names, metadata keys, timeouts, the endpoints file) and the one Envoy
configuration rendered from it (config.py)."""
