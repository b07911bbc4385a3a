# SPDX-License-Identifier: Apache-2.0
"""``vllm-dflash inspect DRAFTER [--target TARGET]`` (reads configs and headers only)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm_dflash.config.drafter_validation import _safetensors_shapes, validate_dflash
from vllm_dflash.config.layer_types import resolve_layer_types

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


def _config(path: str) -> dict[str, Any]:
    f = Path(path) / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: pass a local model directory")
    return json.loads(f.read_text())


def _ns(cfg: dict[str, Any]) -> SimpleNamespace:
    ns = SimpleNamespace(**cfg)
    if not cfg.get("use_sliding_window", True):
        ns.sliding_window = None  # as transformers' Qwen3Config does
    return ns


def inspect_drafter(
    drafter: str, target: str | None = None, aux_shift: bool = True
) -> dict:
    raw = _config(drafter)
    cfg = _ns(raw)
    dflash = raw.get("dflash_config") or {}
    ids = list(dflash.get("target_layer_ids") or [])
    layer_types, window = resolve_layer_types(cfg)
    shapes = _safetensors_shapes(drafter)
    n_params = sum(math.prod(s) for s in shapes.values())
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    kv_bytes = (
        len(layer_types)
        * 2
        * raw["num_key_value_heads"]
        * head_dim
        * _DTYPE_BYTES.get(dtype, 2)
    )
    report: dict[str, Any] = {
        "drafter": str(drafter),
        "architectures": raw.get("architectures"),
        "block_size": raw.get("block_size"),
        "max_num_speculative_tokens": (raw["block_size"] - 1)
        if raw.get("block_size")
        else None,
        "mask_token_id": dflash.get("mask_token_id"),
        "target_layer_ids": ids,
        "vllm_capture_indices": [i + 1 for i in ids] if aux_shift else ids,
        "layers": [
            {
                "index": i,
                "attention": t,
                "window": window if t == "sliding_attention" else None,
            }
            for i, t in enumerate(layer_types)
        ],
        "hidden_size": raw.get("hidden_size"),
        "parameters": n_params,
        "parameters_note": "drafter checkpoint only (embeddings/lm_head shared with the target)"
        if "embed_tokens.weight" not in shapes
        else "drafter checkpoint",
        "dtype": dtype,
        "draft_kv_bytes_per_token": kv_bytes,
        "validated_against": None,
    }
    if target:
        tcfg = _config(target)
        tcfg = tcfg.get("text_config", tcfg)
        validate_dflash(cfg, SimpleNamespace(**tcfg), None, drafter)
        report["validated_against"] = str(target)
        report["target_num_layers"] = tcfg["num_hidden_layers"]
    return report


def format_report(r: dict) -> str:
    lines = [
        f"drafter            {r['drafter']}",
        f"architectures      {r['architectures']}",
        f"block_size         {r['block_size']} (num_speculative_tokens <= {r['max_num_speculative_tokens']})",
        f"mask_token_id      {r['mask_token_id']}",
        f"target_layer_ids   {r['target_layer_ids']} (as configured: outputs of these target layers)",
        f"vLLM capture index {r['vllm_capture_indices']} (residual stream before layer i = after layer i-1)",
        f"parameters         {r['parameters']:,} ({r['parameters_note']})",
        f"draft KV / token   {r['draft_kv_bytes_per_token']:,} bytes ({r['dtype']})",
        "layers:",
    ]
    for layer in r["layers"]:
        w = f", window {layer['window']}" if layer["window"] else ""
        lines.append(f"  {layer['index']:>3}  {layer['attention']}{w}")
    if r["validated_against"]:
        lines.append(
            f"valid for target   {r['validated_against']} ({r['target_num_layers']} layers)"
        )
    return "\n".join(lines)
