"""What a Kubernetes API server does with a custom resource against its CRD's structural schema,
for tests: prune (or, under ``fieldValidation=Strict``, reject) unknown fields, apply ``default:``
values, then validate with an OpenAPI 3.0 validator. Returns readable messages like the API
server's (``spec.objective: Unsupported value...`` becomes ``spec.objective: 'fastest' is not one of
[...]``), and evaluate the CEL rules (``x-kubernetes-validations``, :mod:`helpers.kube.cel`) of
what passed the schema. Messages are cut short as the API server cuts them: a megabyte value is not
echoed back.
"""

from __future__ import annotations

import copy
from typing import Any

from openapi_schema_validator import OAS30Validator

from helpers.kube import cel

# Longer messages lose their middle (the echoed value), keeping the field and what is wrong with it.
MAX_MESSAGE = 1024


def _walk_unknown(schema: dict[str, Any], value: Any, path: str, unknown: list[str], prune: bool) -> None:
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict):
        props = schema.get("properties")
        if props is not None:
            for key in list(value):
                if key not in props:
                    unknown.append(f"{path}.{key}" if path else key)
                    if prune:
                        del value[key]
                else:
                    _walk_unknown(props[key], value[key], f"{path}.{key}" if path else key, unknown, prune)
        elif isinstance(schema.get("additionalProperties"), dict):
            for key, item in value.items():
                _walk_unknown(schema["additionalProperties"], item, f"{path}[{key}]", unknown, prune)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            _walk_unknown(schema["items"], item, f"{path}[{i}]", unknown, prune)


def _defaults(schema: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                _defaults(sub, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _defaults(schema["items"], item)


def admit(schema: dict[str, Any], obj: dict[str, Any], strict: bool = True) -> tuple[dict[str, Any], list[str]]:
    """(the object as stored, error messages). ``apiVersion``, ``kind`` and ``metadata`` are the API
    server's and never pruned, whatever the schema declares."""
    out = copy.deepcopy(obj)
    errors: list[str] = []
    unknown: list[str] = []
    root = dict(schema)
    body = {k: v for k, v in out.items() if k != "metadata"}
    implicit = {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {}}
    _walk_unknown({**root, "properties": {**root.get("properties", {}), **implicit}}, body, "", unknown,
                  prune=not strict)
    if strict and unknown:
        errors += [f'{u}: unknown field "{u.rsplit(".", 1)[-1]}"' for u in unknown]
    _defaults(root, body)
    for err in sorted(OAS30Validator(root).iter_errors({**body, "metadata": out.get("metadata", {})}),
                      key=lambda e: list(e.absolute_path)):
        where = ".".join(str(p) for p in err.absolute_path) or "<root>"
        message = err.message
        if len(message) > MAX_MESSAGE:
            message = message[:MAX_MESSAGE // 2] + " ... " + message[-MAX_MESSAGE // 2:]
        errors.append(f"{where}: {message}")
    if not errors:
        errors += cel.violations(root, body)
    stored = {**body, "metadata": out.get("metadata", {})}
    return stored, errors
