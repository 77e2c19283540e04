"""The data planes: the ways Envoy reaches the service over ext_proc, one module per mode.

- own_envoy.py: the Envoy llm-ring renders (own_envoy_config.py, with its filters, routes and
  clusters in own_envoy_filters.py, own_envoy_routes.py and own_envoy_clusters.py): route and
  observe streams with CEL attributes, and the access log that ends each request;
- picker.py: a Gateway API Inference Extension gateway's Endpoint Picker stream, which
  carries a whole request and whose end ends it (picker_gateways.py describes the gateways the
  tests and the bench run, picker_gateway_config.py renders them, with picker_gateway_upstreams.py).

Each mode is a ``DataPlane`` (plane.py): it recognises its streams' first message, reads the
request, answers it in its own ``AnswerShape`` and learns its end. A stream goes to the first
mode that claims it (registry.py), the last registered asked first: the Endpoint Picker's, which
takes any request, is registered first. A new mode is a module (its Envoy's renderer beside it)
and one ``register`` line. This package's face imports nothing: a renderer is imported without
the service behind the stream handlers.
"""
