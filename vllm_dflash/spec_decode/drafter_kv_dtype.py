# SPDX-License-Identifier: Apache-2.0
"""Backport of vLLM PR #42692: DFlash drafter layers use the engine's KV-cache dtype.

vLLM 0.20.x/0.21.x build the DFlash drafter's decoder layers without a
``cache_config`` (``DFlashQwen3Model.__init__``), so every drafter attention layer
falls back to ``kv_cache_dtype="auto"`` (the model dtype) whatever
``--kv-cache-dtype`` says. With ``--kv-cache-dtype fp8`` the target's pages are
fp8 and the drafter's bf16:

* hybrid (GDN + attention) targets: the drafter's page is twice the target's
  (and the mamba page aligned to it); ``unify_kv_cache_spec_page_size`` scales
  the ``MambaSpec`` block size, which does not change its page, and asserts
  (vLLM #43626, #46480);
* on CUDA ``KVBlockZeroer.init_meta`` asserts "Non-uniform page sizes" when the
  attention layers' pages differ (fp8 target vs bf16 drafter; reported in vLLM
  #37429's discussion for a DFlash + fp8 port, not reproduced here).

Upstream fixed it in #42692 (released in 0.22.0) by passing the engine's
``cache_config`` to the drafter layers: the drafter then stores its K/V in the
target's KV dtype (on FlashAttention 3: fp8 e4m3 with the layer's k/v scales, 1.0
for a drafter checkpoint without scales; the precomputed context K/V go through
the same ``do_kv_cache_update`` quantisation). This patch does that, with a copy
of the engine's cache config that carries no model-level ``sliding_window`` (the
target's window is not the drafter's; the plugin gives sliding drafter layers
their own window) and no ``calculate_kv_scales`` (the context K/V written by
``precompute_and_store_context_kv`` never pass the scale calculation, so the
scales stay 1.0 for every drafter entry). With ``--kv-cache-dtype auto`` the
drafter's KV spec is the same as before. Nothing changes without DFlash: only
``DFlashQwen3DecoderLayer`` is wrapped.

The same PR also makes the proposer's ``token_arange_np`` int32; not backported
(0.20.x DFlash runs with it as it is at bf16, and ``DFlashProposer.__init__`` is
already wrapped by ``dflash_trace``).
"""

from __future__ import annotations

import copy
import types
from typing import Any

from vllm_dflash.registry import (
    ALL_PLATFORMS,
    V020,
    Patch,
    PatchKind,
    original,
    replace_attr,
)

NAME = "dflash_drafter_kv_cache_dtype"


def _unwrapped_model_init() -> Any:
    """``DFlashQwen3Model.__init__`` as written (under ``support_torch_compile``)."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    init = DFlashQwen3Model.__dict__["__init__"]
    for cell in init.__closure__ or ():
        try:
            fn = cell.cell_contents
        except ValueError:  # empty cell
            continue
        if callable(fn) and getattr(fn, "__qualname__", "") == (
            "DFlashQwen3Model.__init__"
        ):
            return fn
    return init


def _reads_attribute(fn: Any, name: str) -> bool:
    """Whether the compiled code of ``fn`` reads attribute/global ``name``."""

    def walk(code: types.CodeType) -> bool:
        return name in code.co_names or any(
            isinstance(c, types.CodeType) and walk(c) for c in code.co_consts
        )

    return walk(original(fn).__code__)


def probe() -> bool:
    """Whether the running vLLM builds the drafter layers without a cache config.

    Building a decoder layer needs a tensor-parallel group, so the question is
    asked of the compiled code: vLLM 0.22+ reads ``.cache_config`` in
    ``DFlashQwen3Model.__init__`` (``cache_config=current_vllm_config.cache_config``),
    the upstream diff (``patches/``) in ``DFlashQwen3DecoderLayer.__init__``
    (``vllm_config.cache_config``); 0.20.x/0.21.x read it in neither (the layer
    only passes its ``cache_config`` argument on, which stays ``None``).
    """
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3DecoderLayer

    return not (
        _reads_attribute(_unwrapped_model_init(), "cache_config")
        or _reads_attribute(DFlashQwen3DecoderLayer.__init__, "cache_config")
    )


def drafter_cache_config(cache_config: Any) -> Any:
    """The engine's cache config as the drafter layers see it (KV dtype kept)."""
    if cache_config is None:
        return None
    drafter = copy.copy(cache_config)
    drafter.sliding_window = None
    drafter.calculate_kv_scales = False
    return drafter


def apply() -> None:
    from vllm.model_executor.models import qwen3_dflash

    layer_init = original(qwen3_dflash.DFlashQwen3DecoderLayer.__init__)

    def __init__(self, vllm_config, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("cache_config") is None and vllm_config is not None:
            kwargs["cache_config"] = drafter_cache_config(
                getattr(vllm_config, "cache_config", None)
            )
        layer_init(self, vllm_config, *args, **kwargs)

    replace_attr(qwen3_dflash.DFlashQwen3DecoderLayer, "__init__", __init__, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.BACKPORT,
    targets=(
        "vllm.model_executor.models.qwen3_dflash:DFlashQwen3DecoderLayer.__init__",
    ),
    summary="DFlash drafter layers store K/V in the engine's --kv-cache-dtype "
    "(fp8 with fp8), not always the model dtype.",
    why="0.20.x/0.21.x build the drafter layers without a cache config: with "
    "--kv-cache-dtype fp8 the drafter keeps bf16 pages, so a hybrid (GDN) target "
    "asserts in unify_kv_cache_spec_page_size at start-up (vllm#43626, #46480).",
    upstream="vllm-project/vllm#42692 (released in 0.22.0)",
    versions=V020,
    platforms=ALL_PLATFORMS,
    probe=probe,
    apply=apply,
    future="Drop when the oldest supported vLLM is 0.22.0; the probe already skips it there.",
)
