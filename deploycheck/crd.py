"""A strict JSON Schema from a CustomResourceDefinition, for check-jsonschema: the
CRD's ``openAPIV3Schema`` of one version, where an object with listed properties
admits no other (the API server would prune an unknown field silently; here it is an
error), ``x-kubernetes-int-or-string`` is an integer or a string, and ``apiVersion``
and ``kind`` are the CRD's. deploy/k8s/schemas/ keeps the results (KEDA's were made
the same way, by hand)::

    python -m deploycheck crd-schema CRD.yaml OUT.json --source "prometheus-operator v0.93.0"
"""

from __future__ import annotations

from typing import Any

KUBERNETES_KEYS = (
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
    "x-kubernetes-validations",
    "x-kubernetes-embedded-resource",
)


def strict(node: Any) -> Any:
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict(v) for k, v in node.items() if k not in KUBERNETES_KEYS}
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    pattern = out.get("pattern")
    if isinstance(pattern, str) and "(?i)" in pattern:
        out["pattern"] = _caseless(pattern.replace("(?i)", ""))
    preserve = out.pop("x-kubernetes-preserve-unknown-fields", False)
    if out.get("type") == "object" and "properties" in out and not preserve:
        out.setdefault("additionalProperties", False)
    return out


def _caseless(pattern: str) -> str:
    """A case-insensitive Go pattern (``(?i)`` removed) without the flag, which JSON
    Schema's ECMA-262 patterns do not have: each letter outside a class as ``[aA]``."""
    out, in_class, escaped = [], False, False
    for char in pattern:
        if escaped:
            out.append(char)
            escaped = False
        elif char == "\\":
            out.append(char)
            escaped = True
        elif char == "[":
            in_class = True
            out.append(char)
        elif char == "]":
            in_class = False
            out.append(char)
        elif char.isascii() and char.isalpha() and not in_class:
            out.append(f"[{char.lower()}{char.upper()}]")
        else:
            out.append(char)
    return "".join(out)


def schema(crd: dict[str, Any], source: str) -> dict[str, Any]:
    spec = crd["spec"]
    [version] = [v for v in spec["versions"] if v.get("storage")]
    group, kind = spec["group"], spec["names"]["kind"]
    body = strict(version["schema"]["openAPIV3Schema"])
    body["properties"]["apiVersion"] = {"const": f"{group}/{version['name']}"}
    body["properties"]["kind"] = {"const": kind}
    body["properties"]["metadata"] = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
            "namespace": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    }
    body["required"] = sorted({*body.get("required", []), "apiVersion", "kind", "metadata"})
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$id": f"https://custody.invalid/schemas/{kind.lower()}-{version['name']}.json",
        "title": f"{kind} ({group}/{version['name']})",
        "description": (
            f"Derived from the openAPIV3Schema of the {spec['names']['plural']}.{group} CRD"
            f" ({source}) by deploycheck.crd, made strict: unknown fields are errors here."
        ),
        **body,
    }
