# SPDX-License-Identifier: Apache-2.0
"""Refuse quantized DFlash drafters, before weights load (vLLM #51581, #53116).

vLLM's DFlash drafter reads raw projection weights: the fused context-K/V GEMM
(``DFlashQwen3Model._build_fused_kv_buffers`` slices ``qkv_proj.weight`` and
applies it with ``F.linear``) and the query attention (``F.linear`` on
``qkv_proj.weight``) both bypass the layer's ``quant_method``; 0.20.x/0.21.x do
not even pass the drafter's quant config to its decoder layers. An FP8/INT8
drafter therefore crashes at start-up (dtype mismatch), loads packed codes as
weights, or drops its scales (silently wrong drafts). Upstream's fix (PR #53122,
open) dequantizes the slices; it is not exact for every scheme, so the plugin
refuses with one line instead: run the drafter unquantized (it is small).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm_dflash.config.layer_types import DrafterConfigError
from vllm_dflash.registry import (
    ALL_PLATFORMS,
    V020,
    Patch,
    PatchKind,
    is_patched,
    replace_attr,
)

NAME = "dflash_refuse_quantized_drafter"


def _quant_name(value: Any) -> str | None:
    if not value:
        return None
    if isinstance(value, dict):
        return str(value.get("quant_method") or value.get("format") or "yes")
    return str(getattr(value, "quant_method", None) or value)


def _refuse(model: Any, method: str) -> None:
    if not bypass_quant_method():
        return  # this vLLM's DFlash drafter honours quant_method
    raise DrafterConfigError(
        f"speculative_config model {model} is quantized (quantization={method!r}): "
        "this vLLM's DFlash drafter applies raw weights and bypasses quant_method "
        "(vllm#51581, #53116); use the unquantized (bf16/fp16) drafter checkpoint "
        "and drop speculative_config.quantization."
    )


def check_raw(speculative_config: Any, raw_drafter_config: dict | None) -> None:
    """Refuse from the user's speculative_config dict and the drafter's config.json."""
    if not isinstance(speculative_config, dict):
        return
    model = speculative_config.get("model")
    method = _quant_name(speculative_config.get("quantization"))
    if method is None and raw_drafter_config is not None:
        method = _quant_name(raw_drafter_config.get("quantization_config"))
    if method is not None:
        _refuse(model, method)


def check_vllm_config(vllm_config: Any) -> None:
    """Refuse from the built config (drafters given by hub id land here)."""
    spec = vllm_config.speculative_config
    if spec is None or spec.method != "dflash":
        return
    draft = spec.draft_model_config
    if draft is None:
        return
    method = _quant_name(getattr(draft, "quantization", None)) or _quant_name(
        getattr(draft.hf_config, "quantization_config", None)
    )
    if method is not None:
        _refuse(draft.model, method)


def probe() -> bool:
    """Cheap gate at start-up: this vLLM has the DFlash drafter the refusal is
    about. The behavioural question (:func:`bypass_quant_method`: does it
    apply raw quantized weights?) imports the drafter's model stack (~2 s), so
    it is asked only when a quantized DFlash drafter is actually configured; a
    vLLM that fixed it then runs the drafter."""
    import importlib.util

    return (
        importlib.util.find_spec("vllm.model_executor.models.qwen3_dflash") is not None
    )


@functools.cache
def bypass_quant_method() -> bool:
    """True if vLLM's fused context-K/V build takes a quantized projection's
    stored weight as is (int8 storage, non-default quant_method)."""
    import torch
    from vllm.model_executor.layers.linear import LinearMethodBase
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    class _Int8Method(LinearMethodBase):
        def create_weights(self, *args: Any, **kwargs: Any) -> None:
            raise NotImplementedError

        def apply(self, layer: Any, x: Any, bias: Any = None) -> Any:
            raise NotImplementedError

    head, q_heads, kv_heads, hidden = 8, 2, 1, 16
    q_size, kv_size = q_heads * head, kv_heads * head
    eps = SimpleNamespace(variance_epsilon=1e-6, weight=torch.ones(head))
    attn = SimpleNamespace(
        qkv_proj=SimpleNamespace(
            weight=torch.ones(q_size + 2 * kv_size, hidden, dtype=torch.int8),
            bias=None,
            quant_method=_Int8Method(),
        ),
        q_size=q_size,
        kv_size=kv_size,
        head_dim=head,
        num_kv_heads=kv_heads,
        q_norm=eps,
        k_norm=eps,
        rotary_emb=SimpleNamespace(
            head_size=head, cos_sin_cache=torch.zeros(4, head), is_neox_style=True
        ),
        attn=None,
    )
    model = SimpleNamespace(
        layers=[SimpleNamespace(self_attn=attn)],
        hidden_norm=SimpleNamespace(weight=torch.ones(hidden)),
    )
    DFlashQwen3Model._build_fused_kv_buffers(model)
    fused = getattr(model, "_fused_kv_weight", None)
    return fused is not None and not fused.is_floating_point()


def _raw_config(speculative_config: Any) -> dict | None:
    model = (
        speculative_config.get("model")
        if isinstance(speculative_config, dict)
        else None
    )
    cfg_file = Path(str(model)) / "config.json" if model else None
    if cfg_file is None or not cfg_file.is_file():
        return None
    return json.loads(cfg_file.read_text())


def apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    if is_patched(EngineArgs.create_engine_config, NAME):
        return
    stock = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        spec = self.speculative_config
        if isinstance(spec, dict) and spec.get("method") in (None, "dflash"):
            check_raw(spec, _raw_config(spec))  # before vLLM parses the drafter
        config = stock(self, *args, **kwargs)
        check_vllm_config(config)  # drafters given by hub id land here
        return config

    replace_attr(EngineArgs, "create_engine_config", create_engine_config, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FIX,
    # The probe asks DFlashQwen3Model._build_fused_kv_buffers (see probe()).
    targets=("vllm.engine.arg_utils:EngineArgs.create_engine_config",),
    summary="One-line refusal of a quantized DFlash drafter (checkpoint or "
    "speculative_config.quantization), before weights load.",
    why="The drafter's fused context-K/V GEMM and query attention bypass "
    "quant_method: FP8/INT8 drafters crash at start-up or draft from unscaled codes.",
    upstream="refuses vllm-project/vllm#51581, #53116 (fix PR #53122 open)",
    versions=V020,
    platforms=ALL_PLATFORMS,
    probe=probe,
    apply=apply,
    future="Drop when a release builds the fused K/V through quant_method; the probe "
    "then reports it not needed.",
)
