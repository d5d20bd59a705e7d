"""The CRD's openAPIV3Schema accepts every example spec, rejects what the spec parser rejects, and names the
same fields as deploy/spec.py."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from deploy.spec import SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "deploy" / "crd.yaml").read_text())
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))


def _strict(schema: dict) -> dict:
    """The schema as `kubectl apply --validate=strict` applies it: unknown object fields are errors."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if node.get("type") == "object" and "properties" in node:
            node.setdefault("additionalProperties", False)
        stack += [v for v in node.get("properties", {}).values()]
        stack += [node[k] for k in ("items", "additionalProperties") if isinstance(node.get(k), dict)]
    schema["properties"]["metadata"].pop("additionalProperties")  # ObjectMeta: Kubernetes' own schema
    return schema


SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
# OpenAPI v3.0 schemas use draft-4 semantics (boolean exclusiveMinimum)
VALIDATOR = jsonschema.Draft4Validator(_strict(SCHEMA))


def test_crd_is_a_valid_kubernetes_object():
    kubernetes_validate.validate(CRD, "1.33.0", strict=True)
    assert CRD["metadata"]["name"] == "batongraphdeployments.baton.ai"
    assert CRD["spec"]["versions"][0]["name"] == "v1alpha1"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_crd_schema_accepts_examples(example):
    VALIDATOR.validate(yaml.safe_load(example.read_text()))


@pytest.mark.parametrize(("edit", "field"), [
    (lambda s: s.pop("model"), "model"),
    (lambda s: s["services"]["decode"].update(replicas=-1), "replicas"),
    (lambda s: s["kvTransport"].update(backend="carrier-pigeon"), "backend"),
    (lambda s: s["services"]["prefill"].update(replicaz=2), "replicaz"),
    (lambda s: s.update(shmSize="big"), "shmSize"),
])
def test_crd_schema_and_parser_reject_the_same_bad_specs(edit, field):
    data = yaml.safe_load(EXAMPLES[0].read_text())
    edit(data["spec"])
    with pytest.raises(jsonschema.ValidationError) as info:
        VALIDATOR.validate(data)
    assert field in str(info.value)
    with pytest.raises(SpecError):
        parse_spec(data)


def test_crd_fields_are_the_fields_the_parser_reads():
    """A spec holding every field the CRD declares parses: the schema names no field the parser lacks."""
    full = _every_field(SCHEMA["properties"]["spec"])
    full["services"]["redis"].pop("externalUrl")  # in-cluster Redis and an external URL exclude each other
    full["services"]["redis"].pop("replicas")
    full["services"]["router"]["resources"].pop("gpu")  # the parser refuses GPUs on the router
    full["services"]["router"]["tensorParallelSize"] = 1
    data = {"apiVersion": "baton.ai/v1alpha1", "kind": "BatonGraphDeployment", "metadata": {"name": "full"},
            "spec": full}
    VALIDATOR.validate(data)
    parse_spec(data)


def _every_field(schema: dict) -> object:
    """A sample value for a schema node, with every declared property filled in."""
    if "properties" in schema:
        return {name: _every_field(sub) for name, sub in schema["properties"].items()}
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        return {"KEY": "value"}
    if kind == "array":
        return ["--flag"]
    if kind in ("integer", "number"):
        return max(schema.get("minimum", 1), 1) * 2
    if kind == "boolean":
        return True
    if schema.get("pattern", "").startswith("^rediss?"):
        return "redis://redis:6379/0"
    return "16Gi" if "Gi" in schema.get("pattern", "") else "x"
