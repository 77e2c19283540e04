"""What every Envoy we render and the routing service share: the contract (contract.py: header
names, metadata keys, timeouts, the endpoints file), the HTTP surface (surface.py) and the CORS
policy (cors.py); and the front Envoy before several gateways (front.py). Each data plane's
Envoy is rendered beside its mode, in extproc/service/dataplanes/."""
