"""The model layer: one module per decoder family (JAX-free, read by the operator through
``service.modelspec``), the registry that picks a family from a checkpoint's config.json, and the
shared layers the forward passes are built from (``layers``, which imports JAX: never import it here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from switchyard.service.model import llama, mistral, qwen2, qwen3
from switchyard.service.model.family import Family, FamilyConfigError

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY)}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(t for f in FAMILIES.values() for t in f.model_types)
_BY_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in f.model_types}
_BY_ARCHITECTURE = {a: f for f in FAMILIES.values() for a in f.architectures}

__all__ = ["FAMILIES", "SUPPORTED_MODEL_TYPES", "Family", "FamilyConfigError", "family", "family_for_config"]


def family(model_type: Any) -> Family:
    """The family of ``model_type``; one line naming the supported ones otherwise."""
    found = _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if found is None:
        raise FamilyConfigError(
            f"model_type {model_type!r:.40} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return found


def family_for_config(config: Mapping[str, Any]) -> Family:
    """The family a config.json names: its ``model_type``, else its first known ``architectures``
    entry, else Llama (config files written before ``model_type`` existed)."""
    if "model_type" in config:
        return family(config["model_type"])
    architectures = config.get("architectures")
    if isinstance(architectures, list):
        for name in architectures:
            if isinstance(name, str) and name in _BY_ARCHITECTURE:
                return _BY_ARCHITECTURE[name]
        if architectures:
            raise FamilyConfigError(f"architectures {architectures!r:.60} are not supported (supported: "
                                    f"{', '.join(_BY_ARCHITECTURE)})")
    return llama.FAMILY
