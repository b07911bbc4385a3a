# SPDX-License-Identifier: Apache-2.0
"""Backport of vLLM #42971 + #43733: DFlash lookahead KV slots (scheduler).

The DFlash drafter writes the K/V of its query block ``[newest token, mask x k]``
(``k + 1`` tokens, positions ``p+1 .. p+k+1`` after the last accepted position
``p``) into the draft KV cache through the request's block table. vLLM 0.20.x to
0.22.x allocate ``k`` lookahead slots, and none at a request's first schedule,
although the first draft runs in the same step as the prefill. Whenever the
query block crosses the end of the request's last block (a prompt that ends on
a block boundary, for one), the block table entry is one the request does not
own: zero (the null block) or a stale id left in the row by another request
(``BlockTable.move_row`` on condense), which may be a live request's block or a
prefix-cached block that other requests reuse. The drafter overwrites its K/V.

Fix (as upstream 0.23.0): DFlash reserves ``k + 1`` lookahead slots, also at the
first schedule, except where the KV of the prompt loads asynchronously
(``delay_cache_blocks``, P/D disaggregation), which upstream also exempts.
"""

from __future__ import annotations

import functools
import inspect
from types import SimpleNamespace
from typing import Any

from vllm_dflash.logger import vllm_logs_silenced
from vllm_dflash.registry import (
    ALL_PLATFORMS,
    V020,
    Patch,
    PatchKind,
    original,
    replace_attr,
)

NAME = "dflash_lookahead_slots"

_PROBE_K = 2
_PROBE_BLOCK = 16


def dflash_lookahead(speculative_config: Any) -> int | None:
    """Lookahead slots a DFlash request needs (``k + 1``); None if not DFlash."""
    if speculative_config is None or getattr(speculative_config, "method", None) != (
        "dflash"
    ):
        return None
    return int(speculative_config.num_speculative_tokens) + 1


def build_scheduler(
    num_speculative_tokens: int,
    block_size: int,
    num_blocks: int = 8,
    prefix_caching: bool = False,
    stock: bool = True,
) -> Any:
    """A real vLLM Scheduler + KVCacheManager for a DFlash config (no model).

    The model and speculative configs are stand-ins that answer only what the
    scheduler asks; the speculative one uses SpeculativeConfig's own methods.
    ``stock``: vLLM's own ``Scheduler.__init__`` even where this patch is applied.
    """
    import torch
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig
    from vllm.config.speculative import SpeculativeConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    max_len = (num_blocks - 1) * block_size
    spec = SimpleNamespace(
        method="dflash", num_speculative_tokens=num_speculative_tokens
    )
    for name in ("use_eagle", "use_dflash", "uses_draft_model"):
        fn = getattr(SpeculativeConfig, name, None)
        if fn is not None:
            setattr(spec, name, fn.__get__(spec))
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_len,
            max_num_seqs=4,
            max_model_len=max_len,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=block_size, enable_prefix_caching=prefix_caching
        ),
    )
    model_config = SimpleNamespace(
        max_model_len=max_len,
        is_encoder_decoder=False,
        enable_return_routed_experts=False,
        is_multimodal_model=False,
        runner_type="generate",
        architectures=[],
    )
    object.__setattr__(vllm_config, "model_config", model_config)
    object.__setattr__(vllm_config, "speculative_config", spec)
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    attn = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=1, shared_by=["layer"])],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], attn)],
    )
    init = original(Scheduler.__init__) if stock else Scheduler.__init__
    sched = Scheduler.__new__(Scheduler)
    init(sched, vllm_config, kv_cache_config, SimpleNamespace(), block_size=block_size)
    return sched


def first_schedule_blocks(sched: Any, prompt_len: int) -> int:
    """Blocks the scheduler gives a new ``prompt_len``-token request."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    req = Request("probe", list(range(1, prompt_len + 1)), SamplingParams(), None)
    sched.add_request(req)
    out = sched.schedule()
    (new,) = out.scheduled_new_reqs
    return len(new.block_ids[0])


def probe() -> bool:
    """True if a new DFlash request whose query block crosses its last block
    gets too few blocks (prompt ``B - k`` tokens: needs ``B + 1`` slots)."""
    k, b = _PROBE_K, _PROBE_BLOCK
    with vllm_logs_silenced():  # its stand-in config is not the user's
        sched = build_scheduler(k, b)
        return first_schedule_blocks(sched, b - k) < 2


def _wrap_allocate(manager: Any, lookahead: int) -> None:
    """Raise the lookahead of every allocation to ``lookahead`` unless the KV
    loads asynchronously (the scheduler passes both by keyword)."""
    stock = manager.allocate_slots
    sig = inspect.signature(stock)

    @functools.wraps(stock)
    def allocate_slots(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 2:  # not how vLLM calls it: normalise to keywords
            bound = sig.bind(*args, **kwargs)
            args, kwargs = (), dict(bound.arguments)
        if (
            not kwargs.get("delay_cache_blocks", False)
            and kwargs.get("num_lookahead_tokens", 0) < lookahead
        ):
            kwargs["num_lookahead_tokens"] = lookahead
        return stock(*args, **kwargs)

    manager.allocate_slots = allocate_slots


def apply() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    stock_init = original(Scheduler.__init__)

    @functools.wraps(stock_init)
    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        stock_init(self, vllm_config, *args, **kwargs)
        lookahead = dflash_lookahead(vllm_config.speculative_config)
        if lookahead is None:
            return
        self.num_lookahead_tokens = max(self.num_lookahead_tokens, lookahead)
        _wrap_allocate(self.kv_cache_manager, self.num_lookahead_tokens)

    replace_attr(Scheduler, "__init__", __init__, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.BACKPORT,
    # __init__ sets k+1 lookahead slots and wraps this scheduler's
    # kv_cache_manager.allocate_slots (first-schedule lookahead).
    targets=("vllm.v1.core.sched.scheduler:Scheduler.__init__",),
    summary=(
        "DFlash requests get k+1 lookahead KV slots, also at their first schedule "
        "(unless their KV loads asynchronously)."
    ),
    why=(
        "The first draft runs with the prefill and writes k+1 query K/V past the "
        "prompt: with no (or k) lookahead slots it writes into blocks the request "
        "does not own (null, another request's, or prefix-cached shared blocks)."
    ),
    upstream="vllm-project/vllm#42971 + #43733 (released in 0.23.0)",
    versions=V020,
    platforms=ALL_PLATFORMS,
    probe=probe,
    apply=apply,
    future="Drop when the oldest supported vLLM is 0.23.0; the probe already skips it there.",
)
