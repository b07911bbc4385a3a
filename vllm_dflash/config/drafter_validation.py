# SPDX-License-Identifier: Apache-2.0
"""DFlash drafter config checks, run when vLLM builds its config (before weights load).

Each problem is one line naming the field, the value, what is allowed and the fix.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from vllm_dflash.config.layer_types import (
    DrafterConfigError,
    resolve_layer_types,
)
from vllm_dflash.registry import raise_if_failed


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    return getattr(cfg, key, default)


def _safetensors_shapes(model_dir: str) -> dict[str, list[int]]:
    """Tensor shapes from local safetensors headers (no tensor data is read)."""
    shapes: dict[str, list[int]] = {}
    d = Path(model_dir)
    if not d.is_dir():
        return shapes  # a hub id: not downloaded here, checked at load time
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                shapes[name] = meta["shape"]
    return shapes


def validate_dflash(
    drafter_cfg: Any,
    target_cfg: Any,
    num_speculative_tokens: int | None,
    drafter_path: str | None = None,
) -> None:
    """Raise DrafterConfigError for the first problem found."""
    target_layers = int(_get(target_cfg, "num_hidden_layers"))
    target_vocab = int(_get(target_cfg, "vocab_size"))
    target_hidden = int(_get(target_cfg, "hidden_size"))
    dflash = _get(drafter_cfg, "dflash_config") or {}
    if not isinstance(dflash, dict):
        dflash = {}

    ids = dflash.get("target_layer_ids")
    if ids is None:
        ids = _get(drafter_cfg, "eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise DrafterConfigError(
            "drafter config dflash_config.target_layer_ids is missing: list the target "
            f"decoder layers (0..{target_layers - 2}) whose outputs feed the drafter, "
            'e.g. "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33]}.'
        )
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DrafterConfigError(
            f"drafter config dflash_config.target_layer_ids={ids!r}: entries must be integers."
        )
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise DrafterConfigError(
            f"drafter config dflash_config.target_layer_ids={ids!r} repeats {dup}: "
            "each target layer may appear once; remove the duplicates."
        )
    bad = [i for i in ids if not 0 <= i <= target_layers - 2]
    if bad:
        raise DrafterConfigError(
            f"drafter config dflash_config.target_layer_ids={ids!r} has {bad} outside "
            f"0..{target_layers - 2} for this {target_layers}-layer target (vLLM can "
            "capture the output of every layer but the last): fix the ids or the target model."
        )

    mask = dflash.get("mask_token_id")
    if mask is None:
        raise DrafterConfigError(
            "drafter config dflash_config.mask_token_id is missing: set it to the token id "
            f"the drafter was trained with as mask (0..{target_vocab - 1})."
        )
    if (
        not isinstance(mask, int)
        or isinstance(mask, bool)
        or not 0 <= mask < target_vocab
    ):
        raise DrafterConfigError(
            f"drafter config dflash_config.mask_token_id={mask!r} is not a token id of the "
            f"target (vocab_size {target_vocab}): use 0..{target_vocab - 1}."
        )

    resolve_layer_types(drafter_cfg)

    block = _get(drafter_cfg, "block_size")
    if (
        isinstance(block, int)
        and num_speculative_tokens is not None
        and num_speculative_tokens > block - 1
    ):
        raise DrafterConfigError(
            f"speculative_config num_speculative_tokens={num_speculative_tokens} exceeds "
            f"the drafter's block_size - 1 = {block - 1} (block_size {block}): "
            f"use num_speculative_tokens <= {block - 1}."
        )

    draft_hidden = int(_get(drafter_cfg, "hidden_size"))
    fc_in = int(_get(drafter_cfg, "target_hidden_size") or target_hidden) * len(ids)
    shapes = _safetensors_shapes(drafter_path) if drafter_path else {}
    shares_embed = (
        shapes
        and "embed_tokens.weight" not in shapes
        and not any(k.endswith("embed_tokens.weight") for k in shapes)
    )
    if (shares_embed or not shapes) and draft_hidden != target_hidden:
        raise DrafterConfigError(
            f"drafter config hidden_size={draft_hidden} but the target's is {target_hidden}: "
            "a DFlash drafter shares the target's embeddings and lm_head; use the drafter "
            "trained for this target."
        )
    # What vLLM's drafter builds fc for (qwen3_dflash: target_layer_ids, else
    # layer_ids, else its own layer count; x target_hidden_size, else hidden_size)
    # must equal what the target delivers (hidden_size per captured layer): the
    # check vllm#48113 makes at the first draft, here before weights load.
    n_fc = len(ids) if "target_layer_ids" in dflash else None
    if n_fc is None and isinstance(dflash.get("layer_ids"), list):
        n_fc = len(dflash["layer_ids"])
    if n_fc is None:
        n_fc = int(_get(drafter_cfg, "num_hidden_layers"))
    fc_width = _get(drafter_cfg, "target_hidden_size", None)
    fc_width = int(fc_width) if fc_width is not None else draft_hidden
    if fc_width * n_fc != target_hidden * len(ids):
        raise DrafterConfigError(
            f"drafter fc takes {n_fc} x {fc_width} = {fc_width * n_fc} features "
            f"(target_hidden_size={_get(drafter_cfg, 'target_hidden_size', None)}) but "
            f"the target delivers {len(ids)} layers x hidden_size {target_hidden} = "
            f"{target_hidden * len(ids)}: set target_hidden_size={target_hidden} and "
            "one target_layer_ids entry per fc input, or use the drafter trained for "
            "this target."
        )
    fc = shapes.get("fc.weight")
    if fc is not None and list(fc) != [draft_hidden, fc_in]:
        raise DrafterConfigError(
            f"drafter checkpoint fc.weight has shape {list(fc)} but target hidden size "
            f"{target_hidden} x {len(ids)} target_layer_ids needs [{draft_hidden}, {fc_in}]: "
            "the drafter was trained for another target or another target_layer_ids."
        )
    draft_vocab = _get(drafter_cfg, "draft_vocab_size") or _get(
        drafter_cfg, "vocab_size"
    )
    if (
        draft_vocab is not None
        and int(draft_vocab) != target_vocab
        and "d2t" not in shapes
    ):
        raise DrafterConfigError(
            f"drafter config vocab_size={draft_vocab} but the target's is {target_vocab} and "
            "the checkpoint has no d2t mapping: use the drafter trained for this target."
        )


def validate_vllm_config(vllm_config: Any) -> None:
    spec = vllm_config.speculative_config
    if spec is None or spec.method != "dflash" or spec.draft_model_config is None:
        return
    raise_if_failed()  # a DFlash patch that could not apply: refuse, loudly
    target_cfg = vllm_config.model_config.hf_text_config
    validate_dflash(
        spec.draft_model_config.hf_config,
        target_cfg,
        spec.num_speculative_tokens,
        spec.draft_model_config.model,
    )


def prevalidate_raw(speculative_config: Any) -> None:
    """Checks on the drafter's raw config.json that must run before transformers
    parses it (transformers rejects a wrong-length layer_types with a multi-line
    error of its own)."""
    if not isinstance(speculative_config, dict):
        return
    model = speculative_config.get("model")
    method = speculative_config.get("method")
    if not model or (method not in (None, "dflash")):
        return
    cfg_file = Path(str(model)) / "config.json"
    if method is None and "dflash" not in str(model).lower():
        return
    raw = json.loads(cfg_file.read_text()) if cfg_file.is_file() else None
    if raw is None:
        return
    if "num_hidden_layers" in raw and raw.get("layer_types") is not None:
        from types import SimpleNamespace

        resolve_layer_types(
            SimpleNamespace(
                num_hidden_layers=raw["num_hidden_layers"],
                layer_types=raw["layer_types"],
                sliding_window=raw.get(
                    "sliding_window", 1
                ),  # window checked after parsing
            )
        )
