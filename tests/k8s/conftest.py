"""The fake API server's fixtures (fake_cluster.py), shared with tests/discovery."""

from fake_cluster import apiserver, kubeconfig  # noqa: F401 - fixtures
