"""CRD ``x-kubernetes-validations`` rules, evaluated as the Kubernetes API server does, for tests.

Each rule is a CEL expression over ``self`` (the value at its schema node), run with cel-python and
the part of the Kubernetes CEL library the DecodeService CRD uses: ``quantity()`` with
``isLessThan``, ``isGreaterThan`` and ``compareTo``. A rule is evaluated only where its value is
present; a failed rule reads as the API server words it: ``spec.tolerations[0]: Invalid value:
"object": <message>``.
"""

from __future__ import annotations

import functools
import re
from decimal import Decimal, InvalidOperation
from typing import Any

import celpy
from celpy import celtypes

_QUANTITY = re.compile(r"([+-]?[0-9]+(?:\.[0-9]*)?|[+-]?\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?")
_SUFFIX = {"": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": Decimal(10**3),
           "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15),
           "E": Decimal(10**18), "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30),
           "Ti": Decimal(2**40), "Pi": Decimal(2**50), "Ei": Decimal(2**60)}


class Quantity:
    """A Kubernetes resource quantity ("500m", "16Gi", "1e3"), compared by value."""

    def __init__(self, text: str) -> None:
        m = _QUANTITY.fullmatch(str(text))
        if not m:
            raise ValueError(f"quantity: {text!r} is not a quantity")
        suffix = m.group(2) or ""
        try:
            scale = Decimal(10) ** int(suffix[1:]) if suffix[:1] in ("e", "E") else _SUFFIX[suffix]
            self.value = Decimal(m.group(1)) * scale
        except InvalidOperation as err:
            raise ValueError(f"quantity: {text!r} is out of range") from err


def _quantity(text: Any) -> Quantity:
    return Quantity(str(text))


def _less(a: Quantity, b: Quantity) -> celtypes.BoolType:
    return celtypes.BoolType(a.value < b.value)


def _greater(a: Quantity, b: Quantity) -> celtypes.BoolType:
    return celtypes.BoolType(a.value > b.value)


def _compare(a: Quantity, b: Quantity) -> celtypes.IntType:
    return celtypes.IntType((a.value > b.value) - (a.value < b.value))


FUNCTIONS = {"quantity": _quantity, "isLessThan": _less, "isGreaterThan": _greater, "compareTo": _compare}


@functools.cache
def _program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule), functions=FUNCTIONS)


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    return type(value).__name__ if not isinstance(value, str) else "string"


def violations(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Messages of every rule under ``schema`` that ``value`` breaks (``path`` names ``value``)."""
    out: list[str] = []
    for rule in schema.get("x-kubernetes-validations") or []:
        try:
            ok = bool(_program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)}))
        except Exception as err:  # a rule that errors rejects the value, as on the API server
            ok, message = False, f"{rule.get('message') or rule['rule']} (error: {err})"
        else:
            message = rule.get("message") or f"failed rule: {rule['rule']}"
        if not ok:
            out.append(f'{path or "<root>"}: Invalid value: "{_kind(value)}": {message}')
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for key, item in value.items():
            sub = props.get(key, schema.get("additionalProperties") if isinstance(
                schema.get("additionalProperties"), dict) else None)
            if sub is not None:
                where = (f"{path}.{key}" if path else key) if key in props else f"{path}[{key}]"
                out += violations(sub, item, where)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += violations(schema["items"], item, f"{path}[{i}]")
    return out
