# SPDX-License-Identifier: Apache-2.0
"""The ``draft_length`` key of a DFlash ``--speculative-config``.

``"fixed"`` (default): every step verifies all ``num_speculative_tokens`` drafts,
as vLLM does. ``"adaptive"``: the scheduler picks how many of them each step
verifies, from the measured step time and acceptance
(``vllm_dflash/core/adaptive_draft_length.py``); with 0 the drafter only stores
its context. vLLM's ``SpeculativeConfig`` forbids unknown keys, so the key is
taken out of the dict before vLLM parses it and kept in
``VllmConfig.additional_config["vllm_dflash"]`` (vLLM's field for plugins), which
reaches the engine core and the workers with the rest of the config.
"""

from __future__ import annotations

from typing import Any

from vllm_dflash.config.layer_types import DrafterConfigError

KEY = "draft_length"
FIXED = "fixed"
ADAPTIVE = "adaptive"
MODES = (FIXED, ADAPTIVE)
ADDITIONAL_CONFIG_KEY = "vllm_dflash"
EXAMPLE = (
    '-sc \'{"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16", '
    '"num_speculative_tokens": 15, "draft_length": "adaptive"}\''
)


def split(speculative_config: Any) -> tuple[Any, str | None]:
    """(the dict without ``draft_length``, its validated value or None).

    Raises a one-line :class:`DrafterConfigError` for a value that is not allowed
    or a method other than DFlash."""
    if not isinstance(speculative_config, dict) or KEY not in speculative_config:
        return speculative_config, None
    rest = {k: v for k, v in speculative_config.items() if k != KEY}
    value = speculative_config[KEY]
    mode = value.strip().lower() if isinstance(value, str) else value
    if mode not in MODES:
        raise DrafterConfigError(
            f"speculative_config.{KEY}={value!r} is not allowed: use "
            f'"{FIXED}" (verify all num_speculative_tokens drafts every step; the '
            f'default) or "{ADAPTIVE}" (verify as many as pay off for the batch), '
            f"e.g. {EXAMPLE}"
        )
    method = rest.get("method")
    if method not in (None, "dflash"):
        raise DrafterConfigError(
            f"speculative_config.{KEY}={value!r} applies to method 'dflash' only "
            f"(method is {method!r}): remove {KEY}, or use method 'dflash'"
        )
    return rest, mode


def store(vllm_config: Any, mode: str | None) -> None:
    if mode is None or vllm_config.speculative_config is None:
        return
    parallel = vllm_config.parallel_config
    for name in ("data_parallel_size", "pipeline_parallel_size"):
        size = getattr(parallel, name, 1)
        if mode == ADAPTIVE and size > 1:
            raise DrafterConfigError(
                f"speculative_config.{KEY}='adaptive' with {name}={size}: the draft "
                "length is chosen by each engine's scheduler and is not kept in step "
                f"across ranks yet; use {name}=1 or {KEY}='fixed'"
            )
    extra = vllm_config.additional_config
    if not isinstance(extra, dict):
        raise DrafterConfigError(
            f"speculative_config.{KEY} needs --additional-config to be a JSON "
            f"mapping, got {type(extra).__name__}: pass a mapping or drop {KEY}"
        )
    extra.setdefault(ADDITIONAL_CONFIG_KEY, {})[KEY] = mode


def mode_of(vllm_config: Any) -> str:
    """The draft-length mode of an engine (``fixed`` unless DFlash asked otherwise)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or getattr(spec, "method", None) != "dflash":
        return FIXED
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict):
        return FIXED
    return extra.get(ADDITIONAL_CONFIG_KEY, {}).get(KEY, FIXED)
