"""Discovery tests. The Kubernetes source is tested against the fake API server of tests/k8s
(fake_apiserver.py, k8s_support.py, the fixtures of fake_cluster.py): that folder is put on the
import path, as pytest does for the tests in it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "k8s"))

from fake_cluster import apiserver, kubeconfig  # noqa: E402, F401 - fixtures
