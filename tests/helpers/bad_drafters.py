# SPDX-License-Identifier: Apache-2.0
"""Broken DFlash drafter configs, one per validation rule, made from the dense fixture."""

from __future__ import annotations

import json
import os
from pathlib import Path

# name -> (config edits (None deletes), num_speculative_tokens, expected message fragment)
CASES: dict[str, tuple[dict, int, str]] = {
    "layer_ids_missing": (
        {"dflash_config.target_layer_ids": None},
        4,
        "target_layer_ids is missing",
    ),
    "layer_ids_out_of_range": (
        {"dflash_config.target_layer_ids": [1, 3, 9]},
        4,
        "[9] outside 0..4",
    ),
    "layer_ids_last_layer": (
        {"dflash_config.target_layer_ids": [1, 3, 5]},
        4,
        "[5] outside 0..4",
    ),
    "layer_ids_duplicated": (
        {"dflash_config.target_layer_ids": [1, 1, 4]},
        4,
        "repeats [1]",
    ),
    "mask_missing": (
        {"dflash_config.mask_token_id": None},
        4,
        "mask_token_id is missing",
    ),
    "mask_out_of_vocab": ({"dflash_config.mask_token_id": 512}, 4, "mask_token_id=512"),
    "layer_types_length": (
        {"layer_types": ["full_attention"]},
        4,
        "layer_types has 1 entries",
    ),
    "layer_types_value": (
        {"layer_types": ["full_attention", "linear_attention"]},
        4,
        "linear_attention",
    ),
    "sliding_without_window": (
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "use_sliding_window": False,
            "sliding_window": None,
        },
        4,
        "sliding_window=None",
    ),
    "too_many_spec_tokens": ({}, 9, "num_speculative_tokens=9 exceeds"),
    "fc_input_mismatch": (
        {"dflash_config.target_layer_ids": [1, 3]},
        4,
        "fc.weight has shape [128, 384]",
    ),
    "hidden_mismatch": (
        {"hidden_size": 64},
        4,
        "hidden_size=64 but the target's is 128",
    ),
    "vocab_mismatch": ({"vocab_size": 1000}, 4, "vocab_size=1000"),
    # vllm#48113's mismatch: fc sized for other features than the target delivers.
    "fc_features_mismatch": (
        {"target_hidden_size": 64},
        4,
        "(target_hidden_size=64) but the target delivers 3 layers",
    ),
    # vllm#51581/#53116: the drafter bypasses quant_method (dflash_refuse_quantized_drafter).
    "quantized_checkpoint": (
        {
            "quantization_config": {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
            }
        },
        4,
        "is quantized (quantization='fp8')",
    ),
}


def make(base: Path, out: Path, edits: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((base / "config.json").read_text())
    for key, value in edits.items():
        node, *path = key.split(".")
        holder = cfg
        if path:
            holder = cfg[node]
            node = path[0]
        if value is None:
            holder.pop(node, None)
        else:
            holder[node] = value
    (out / "config.json").write_text(json.dumps(cfg))
    link = out / "model.safetensors"
    if not link.exists():
        os.symlink(base / "model.safetensors", link)
    return out
