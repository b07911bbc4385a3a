# SPDX-License-Identifier: Apache-2.0
"""Exact prefix-cache hits on hybrid (full attention + Mamba/GDN) targets with
EAGLE-style speculation (DFlash counts as EAGLE in vLLM's KV-cache manager).

A prefix-cache hit must cover, in every KV-cache group, the tokens it claims.
``HybridKVCacheCoordinator.find_longest_cache_hit`` of vLLM 0.20.x-0.22.x looks
for the longest prefix every group holds. With speculation each group in
``eagle_attn_group_indices`` may look one block further and then drops its last
matched block (the drafter needs the hidden states of that block recomputed).
Every group is in that set when the drafter has no KV group of its own marked
EAGLE, Mamba groups included; but ``MambaManager.find_longest_cache_hit`` never
drops a block. So the Mamba group answers one block past the full-attention
group's popped hit, and the coordinator takes the Mamba answer as the common
hit: the request then starts with ``hit_length`` computed tokens of which the
full-attention layers hold one block fewer. Those tokens' K/V slots are fresh,
uncomputed blocks: the target's output changes after the hit (with DFlash on the
tiny Qwen3.5-shaped hybrid: 3 of 8 repeated prompts diverge from their first
token). ``dflash_hybrid_mamba_no_eagle_margin`` gives Mamba groups no EAGLE
margin, as upstream does.

The coordinator then truncates only the first attention type's blocks to the
final hit. Where more than one full-attention type exists (a drafter whose KV
spec differs from the target's attention, beside Mamba groups), the others keep
blocks past the hit: the request's block table then maps later positions to the
wrong blocks. ``dflash_hybrid_full_attention_truncation`` truncates every
full-attention group to the hit.

A third fix, ``dflash_align_shorter_step_blocks``, is not about hits: in 'align'
mode ``MambaManager.allocate_new_blocks`` asserts that a request never needs
fewer blocks than it holds (``cdiv(tokens, block) + speculative blocks``). A
step that schedules fewer draft tokens than the last one (the adaptive draft
length, or a step budget that cuts a request's drafts) after drafts were
rejected needs one block fewer, and the engine dies on that assertion
(reproduced on the CPU backend: the tiny hybrid pair, prefix caching, draft
lengths 4, 0, 0, 2, ...). The fix keeps the blocks the request holds for such a
step: the running GDN state goes to the block of the step's last token
(``preprocess_mamba`` copies it there), the later blocks are reused as the
request grows.

The fixes act on the coordinator of a DFlash engine only (set on it when its
scheduler starts): an engine without DFlash keeps vLLM's coordinator as it is.
:func:`exact_hits` runs both cases on a real ``KVCacheManager`` (no model, CPU,
milliseconds) through the code in force; the start-up check of
``hybrid_prefix_caching`` refuses DFlash + hybrid prefix caching where it fails.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from vllm_dflash.registry import Patch, PatchKind, is_patched, replace_attr
from vllm_dflash.spec_decode import uses_dflash

NAME = "dflash_hybrid_mamba_no_eagle_margin"
TRUNCATE_NAME = "dflash_hybrid_full_attention_truncation"
SHORTER_STEP_NAME = "dflash_align_shorter_step_blocks"

# vLLM 0.20.0-0.22.x keep the EAGLE groups in ``eagle_attn_group_indices``;
# 0.23.0 moved the flag into the attention groups (not covered).
VERSIONS = ">=0.20.0,<0.23.0"
_SCHEDULER_INIT = "vllm.v1.core.sched.scheduler:Scheduler.__init__"

_BLOCK = 8

# The fixes applied in this process (their apply() adds the name). A DFlash
# engine's coordinator gets them when its scheduler starts; so does the
# simulation of exact_hits().
_active: set[str] = set()


# --- the fixes, on one coordinator --------------------------------------------


def drop_mamba_eagle_margin(coordinator: Any) -> None:
    """No EAGLE one-block margin for the coordinator's Mamba attention groups."""
    from vllm.v1.kv_cache_interface import MambaSpec

    coordinator.eagle_attn_group_indices = {
        i
        for i in coordinator.eagle_attn_group_indices
        if not isinstance(coordinator.attention_groups[i][0], MambaSpec)
    }


def truncate_full_attention(
    coordinator: Any, blocks: tuple[list[Any], ...], hit_length: int
) -> None:
    """Cut every full-attention group's hit blocks to ``hit_length`` tokens."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    for spec, group_ids, _ in coordinator.attention_groups:
        if not isinstance(spec, FullAttentionSpec):
            continue
        for group_id in group_ids:
            del blocks[group_id][hit_length // spec.block_size :]


def _truncating_find(
    self: Any, block_hashes: list[Any], max_cache_hit_length: int
) -> tuple[tuple[list[Any], ...], int]:
    blocks, hit_length = type(self).find_longest_cache_hit(
        self, block_hashes, max_cache_hit_length
    )
    truncate_full_attention(self, blocks, hit_length)
    return blocks, hit_length


def _bind_truncating_find(coordinator: Any) -> None:
    coordinator.find_longest_cache_hit = types.MethodType(_truncating_find, coordinator)


def _keeping_allocate(
    self: Any, request_id: str, num_tokens: int, num_tokens_main_model: int
) -> list[Any]:
    need = -(-num_tokens_main_model // self.block_size) + self.num_speculative_blocks
    if need < len(self.req_to_blocks[request_id]):
        return []  # fewer draft tokens than last step: keep what the request holds
    return type(self).allocate_new_blocks(
        self, request_id, num_tokens, num_tokens_main_model
    )


def keep_blocks_on_shorter_steps(coordinator: Any) -> None:
    """The coordinator's 'align' Mamba managers accept a step that needs fewer
    blocks than the request holds."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    for manager in coordinator.single_type_managers:
        if isinstance(manager, MambaManager) and manager.mamba_cache_mode == "align":
            manager.allocate_new_blocks = types.MethodType(_keeping_allocate, manager)


def _is_hybrid(coordinator: Any) -> bool:
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator

    return isinstance(coordinator, HybridKVCacheCoordinator)


def fix_coordinator(coordinator: Any) -> None:
    """Apply this process's active fixes to one coordinator (idempotent)."""
    if not _is_hybrid(coordinator):
        return
    if NAME in _active:
        drop_mamba_eagle_margin(coordinator)
    if TRUNCATE_NAME in _active:
        _bind_truncating_find(coordinator)
    if SHORTER_STEP_NAME in _active:
        keep_blocks_on_shorter_steps(coordinator)


# --- the KV-cache manager simulation (probes and exact_hits) ------------------


def _manager(specs: list[Any]) -> Any:
    """A real KVCacheManager with prefix caching and EAGLE-style speculation over
    one KV-cache group per spec (``specs``), block size ``_BLOCK``."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    # The engine's own seed stays (its block hashes must not change).
    if not hasattr(kv_cache_utils, "NONE_HASH"):
        kv_cache_utils.init_none_hash(sha256)
    groups = [KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)]
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    return KVCacheManager(
        config,
        max_model_len=256,
        max_num_batched_tokens=256,
        enable_caching=True,
        use_eagle=True,
        hash_block_size=_BLOCK,
    )


def _specs(two_attention_types: bool) -> list[Any]:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    specs: list[Any] = [
        FullAttentionSpec(
            block_size=_BLOCK, num_kv_heads=1, head_size=2, dtype=torch.float32
        )
    ]
    if two_attention_types:  # a drafter whose KV spec differs from the target's
        specs.append(
            FullAttentionSpec(
                block_size=_BLOCK, num_kv_heads=2, head_size=1, dtype=torch.float16
            )
        )
    specs.append(
        MambaSpec(
            block_size=_BLOCK,
            shapes=((1,),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
            num_speculative_blocks=0,
        )
    )
    return specs


def _request(request_id: str, num_tokens: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(num_tokens)),
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        block_hasher=get_request_block_hasher(_BLOCK, sha256),
    )


def _hit(
    two_attention_types: bool, fix: Callable[[Any], None] = fix_coordinator
) -> tuple[int, list[int]]:
    """Prefill a 30-token prompt in 'align' chunks (16 + 14, as the scheduler cuts
    them), free it, then look up a 20-token prompt with the same first 20 tokens
    through the coordinator after ``fix`` (default: this process's fixes).
    Returns the hit length and the tokens each group's hit blocks cover."""
    manager = _manager(_specs(two_attention_types))
    fix(manager.coordinator)
    first = _request("first", 30)
    _, hit = manager.get_computed_blocks(first)
    for chunk in (16, 14):
        manager.allocate_slots(
            first, chunk, 0 if first.num_computed_tokens else hit, None
        )
        first.num_computed_tokens += chunk
        manager.new_step_starts()
    manager.free(first)
    second = _request("second", 20)
    hit_blocks, hit = manager.coordinator.find_longest_cache_hit(
        second.block_hashes, second.num_tokens - 1
    )
    return hit, [len(b) * _BLOCK for b in hit_blocks]


def _attention_groups_cover(hit: int, covered: list[int]) -> bool:
    """Every full-attention group holds exactly the hit (the Mamba group, last,
    holds the state at the hit)."""
    return all(tokens == hit for tokens in covered[:-1])


def exact_hits() -> bool:
    """Do a DFlash engine's hybrid prefix-cache hits cover exactly the tokens
    they claim in every full-attention group, with this process's fixes?"""
    return all(_attention_groups_cover(*_hit(two)) for two in (False, True))


# --- the patches: a DFlash scheduler's coordinator gets the fixes ---------------


def _fix_at_scheduler_start(name: str, fix: Callable[[Any], None]) -> None:
    """Wrap Scheduler.__init__: a DFlash engine's hybrid coordinator gets ``fix``."""
    from vllm.v1.core.sched.scheduler import Scheduler

    _active.add(name)
    if wraps_scheduler(Scheduler.__init__, name):
        return
    stock = Scheduler.__init__

    def __init__(self, *args, **kwargs) -> None:
        stock(self, *args, **kwargs)
        coordinator = self.kv_cache_manager.coordinator
        if uses_dflash(self.vllm_config) and _is_hybrid(coordinator):
            fix(coordinator)

    replace_attr(Scheduler, "__init__", __init__, name)


def wraps_scheduler(init: Any, name: str) -> bool:
    """Whether ``init`` (Scheduler.__init__) or a function it wraps is patch
    ``name``'s wrapper."""
    while init is not None:
        if is_patched(init, name):
            return True
        init = getattr(init, "__wrapped_original__", None)
    return False


def _no_fix(coordinator: Any) -> None:
    pass


def probe() -> bool:
    """Does vLLM's coordinator claim a hit past the full-attention blocks?"""
    hit, covered = _hit(False, fix=_no_fix)
    return covered[0] < hit


def apply() -> None:
    _fix_at_scheduler_start(NAME, drop_mamba_eagle_margin)


def truncation_probe() -> bool:
    """Does vLLM's coordinator (Mamba margin dropped) leave a second
    full-attention type's blocks past the hit?"""
    hit, covered = _hit(True, fix=drop_mamba_eagle_margin)
    return not _attention_groups_cover(hit, covered)


def truncation_apply() -> None:
    _fix_at_scheduler_start(TRUNCATE_NAME, _bind_truncating_find)


def _shorter_step(fix: Callable[[Any], None]) -> None:
    """Allocate a request's blocks for a 9-token step with 4 drafts (block 8, two
    speculative blocks), then for a 2-token step without drafts."""
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    spec = MambaSpec(
        block_size=_BLOCK,
        shapes=((1,),),
        dtypes=(torch.float32,),
        mamba_cache_mode="align",
        num_speculative_blocks=2,
    )
    manager = _manager([*_specs(False)[:1], spec])
    fix(manager.coordinator)
    request = _request("r", 6)
    manager.allocate_slots(request, 6, 0, None)
    request.num_computed_tokens = 6
    mamba = manager.coordinator.single_type_managers[-1]
    mamba.allocate_new_blocks("r", 16, 11)  # 6 computed + 1 + 4 drafts: 2 blocks
    mamba.allocate_new_blocks("r", 8, 8)  # 1 accepted + 1 new: 1 block


def shorter_step_probe() -> bool:
    """Does vLLM's 'align' Mamba manager refuse a step needing fewer blocks?"""
    try:
        _shorter_step(_no_fix)
    except AssertionError:
        return True
    return False


def shorter_step_apply() -> None:
    _fix_at_scheduler_start(SHORTER_STEP_NAME, keep_blocks_on_shorter_steps)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.BACKPORT,
    # on the scheduler's HybridKVCacheCoordinator: eagle_attn_group_indices
    targets=(_SCHEDULER_INIT,),
    summary="DFlash engines on hybrid targets: no EAGLE one-block margin for "
    "Mamba/GDN groups in the prefix-cache lookup.",
    why="With speculation every KV group may look one block past the hit and drop "
    "it; the Mamba finder never drops, so the hit grows one block past what the "
    "full-attention layers hold and those tokens read uncomputed K/V (the target's "
    "output changes after a prefix-cache hit).",
    upstream="vllm-project/vllm#49502 (merged to main; not in a release up to 0.23.0)",
    versions=VERSIONS,
    platforms=("cuda", "cpu", "rocm"),
    probe=probe,
    apply=apply,
    future="Drop when the oldest supported vLLM has #49502; the probe skips it there.",
    probe_false_reason="the coordinator's hit never exceeds the full-attention "
    "blocks (vllm#49502)",
)

TRUNCATE_PATCH = Patch(
    name=TRUNCATE_NAME,
    kind=PatchKind.BACKPORT,
    # on the scheduler's HybridKVCacheCoordinator: find_longest_cache_hit
    targets=(_SCHEDULER_INIT,),
    summary="DFlash engines on hybrid targets: every full-attention KV group is cut "
    "to the final prefix-cache hit, not only the first attention type's.",
    why="With two full-attention KV specs (a drafter whose KV spec differs from "
    "the target's) beside Mamba groups, the second type kept blocks past the hit: "
    "its block table then maps later tokens to the wrong blocks.",
    upstream="vllm-project/vllm main (coordinator truncates every full-attention "
    "group); not in a release up to 0.23.0",
    versions=VERSIONS,
    platforms=("cuda", "cpu", "rocm"),
    probe=truncation_probe,
    apply=truncation_apply,
    future="Drop with dflash_hybrid_mamba_no_eagle_margin once upstream releases "
    "both; the probe skips it there.",
    probe_false_reason="the coordinator already cuts every full-attention group "
    "to the hit",
)

SHORTER_STEP_PATCH = Patch(
    name=SHORTER_STEP_NAME,
    kind=PatchKind.FIX,
    # on the scheduler's HybridKVCacheCoordinator: its MambaManagers
    targets=(_SCHEDULER_INIT,),
    summary="DFlash engines with prefix caching on hybrid targets: a step with "
    "fewer draft tokens than the last keeps the GDN blocks the request holds.",
    why="'align' mode asserts a request never needs fewer blocks than it holds; "
    "the adaptive draft length (or a budget that cuts drafts) after rejected "
    "drafts needs one fewer and the engine dies on that assertion.",
    upstream="none (vLLM main still asserts)",
    versions=VERSIONS,
    platforms=("cuda", "cpu", "rocm"),
    probe=shorter_step_probe,
    apply=shorter_step_apply,
    future="Drop when vLLM's MambaManager accepts shorter steps in align mode.",
    probe_false_reason="the 'align' Mamba manager accepts a step needing fewer blocks",
)
