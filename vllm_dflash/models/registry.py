# SPDX-License-Identifier: Apache-2.0
"""Registering the plugin's drafter class with vLLM's model registry.

vLLM inspects a lazily registered out-of-tree model (``"module:Class"``) in a
fresh Python subprocess on every engine start, because it can only cache the
result for files inside its own package: about 10-25 s of start-up (a full
``import torch, vllm``) for every DFlash engine. Importing the drafter module
initialises no device, so the plugin's entry inspects it in-process, still
lazily: processes that never build a DFlash config never import it.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing_extensions import override
from vllm.model_executor.models.registry import (
    ModelRegistry,
    _LazyRegisteredModel,
    _ModelInfo,
)


@dataclass(frozen=True)
class InProcessLazyModel(_LazyRegisteredModel):
    """A lazily imported model class that vLLM inspects in this process."""

    @override
    def inspect_model_cls(self) -> _ModelInfo:
        return _ModelInfo.from_model_cls(self.load_model_cls())


def register_model(arch: str, model_cls: str) -> None:
    """Point ``arch`` at ``model_cls`` ("module:Class"), replacing vLLM's own
    entry without the "already registered" warning; idempotent."""
    module_name, class_name = model_cls.split(":")
    entry = InProcessLazyModel(module_name=module_name, class_name=class_name)
    if ModelRegistry.models.get(arch) != entry:
        ModelRegistry.models[arch] = entry
