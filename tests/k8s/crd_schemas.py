"""Validation of custom resources against the CRDs vendored in tests/k8s/schemas/ (their
sources and commits are in each file's header and in schemas/README.md).

As the API server does with `kubectl apply` (field validation Strict, kubectl's default): the
version's openAPIV3Schema with every object that lists its properties closed to others, unless
it preserves unknown fields. Not checked: the CEL rules (x-kubernetes-validations) and
`metadata` beyond being an object; `kubectl apply --dry-run=server` on a cluster checks those.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMAS = Path(__file__).parent / "schemas"


def _closed(schema: Any) -> Any:
    if isinstance(schema, dict):
        schema = {key: _closed(value) for key, value in schema.items()}
        preserves = schema.get("x-kubernetes-preserve-unknown-fields") is True
        if "properties" in schema and "additionalProperties" not in schema and not preserves:
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    return schema


@functools.cache
def _validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) -> a validator of that version's schema, for every vendored CRD."""
    validators = {}
    for path in sorted(SCHEMAS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = _closed(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
            validators[(f"{group}/{version['name']}", kind)] = jsonschema.Draft202012Validator(schema)
    return validators


def is_custom(doc: dict[str, Any]) -> bool:
    """A kind that one of the vendored CRDs defines (its group, any version)."""
    groups = {api_version.split("/")[0] for api_version, _ in _validators()}
    return "/" in doc["apiVersion"] and doc["apiVersion"].split("/")[0] in groups


def validate_custom(doc: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError naming the first field the CRD's schema refuses."""
    validator = _validators().get((doc["apiVersion"], doc["kind"]))
    if validator is None:
        raise LookupError(f"no vendored CRD serves {doc['kind']} in {doc['apiVersion']}")
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or "(root)"
        raise jsonschema.ValidationError(f"{doc['kind']}/{doc['metadata'].get('name')}: {where}: {error.message}")
