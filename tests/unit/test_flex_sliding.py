# SPDX-License-Identifier: Apache-2.0
"""Sliding + full DFlash layers on vLLM's real FLEX_ATTENTION backend (CPU tensors).

vLLM picks FLEX_ATTENTION for fp32 on CUDA. Its metadata builder keeps
persistent buffers that every block mask it builds points into, and a layer
with a sliding window rebuilds its (window-pruned) mask at forward time. With
one builder for all drafter layers, the full layer after the sliding ones then
attends only to the window's KV blocks: on the H200 that gave drafts 89.0%
equal to the float64 reference. The proposer gives sliding layers a builder of
their own; this test runs the proposer's metadata through vLLM's
FlexAttentionImpl and compares each layer with plain softmax attention.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from vllm_dflash.spec_decode.dflash_proposer import DFlashSWAProposer

BLOCK, NUM_BLOCKS, WINDOW = 16, 64, 6
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
CONTEXT, QUERY = 80, 16  # context K/V already cached, then one 16-token draft block
LAYERS = ["d.0", "d.1", "d.2"]  # sliding, sliding, full (run in this order)


def _vllm_config():
    model = SimpleNamespace(
        get_num_attention_heads=lambda p: HEADS, get_num_kv_heads=lambda p: KV_HEADS,
        get_head_size=lambda: HEAD_DIM, max_model_len=1024, dtype=torch.float32,
    )  # fmt: skip
    return SimpleNamespace(
        model_config=model, parallel_config=None,
        cache_config=SimpleNamespace(num_gpu_blocks=NUM_BLOCKS),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=256),
        compilation_config=SimpleNamespace(cudagraph_mode=None),
    )  # fmt: skip


def _proposer(own_builders: bool) -> DFlashSWAProposer:
    from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.utils import AttentionGroup

    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32
    )
    group = AttentionGroup(
        backend=FlexAttentionBackend, layer_names=list(LAYERS), kv_cache_spec=spec,
        kv_cache_group_id=0,
    )  # fmt: skip
    cfg = _vllm_config()
    group.create_metadata_builders(cfg, torch.device("cpu"))
    p = object.__new__(DFlashSWAProposer)
    p.draft_attn_groups = [group]
    p.sliding_attn_layer_names = frozenset(LAYERS[:2])
    p.vllm_config, p.device = cfg, torch.device("cpu")
    if own_builders:
        p.sliding_builders = p.make_sliding_builders()
    return p


def _cad(block_table: torch.Tensor):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0, QUERY], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl,
        seq_lens=torch.tensor([CONTEXT + QUERY], dtype=torch.int32), num_reqs=1,
        num_actual_tokens=QUERY, max_query_len=QUERY, max_seq_len=CONTEXT + QUERY,
        block_table_tensor=block_table, slot_mapping=torch.arange(CONTEXT, CONTEXT + QUERY),
        causal=False,
    )  # fmt: skip


def _reference(q, kv, block_table, window):
    """Softmax attention of the block's queries over the cached sequence."""
    pos = torch.arange(CONTEXT + QUERY)
    slots = block_table[0, pos // BLOCK].long() * BLOCK + pos % BLOCK
    k, v = (
        cache.reshape(-1, KV_HEADS, HEAD_DIM)[slots].repeat_interleave(
            HEADS // KV_HEADS, 1
        )
        for cache in kv
    )
    scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM**-0.5
    qpos = torch.arange(CONTEXT, CONTEXT + QUERY)[:, None]
    allowed = torch.ones(QUERY, CONTEXT + QUERY, dtype=torch.bool)
    if window is not None:  # sliding layers: causal, last `window` positions
        allowed &= (pos[None] <= qpos) & (qpos - pos[None] < window)
    return torch.einsum(
        "hqk,khd->qhd", scores.masked_fill(~allowed, -torch.inf).softmax(-1), v
    )


def _max_errors(own_builders: bool) -> dict[str, float]:
    from vllm.v1.attention.backends.flex_attention import FlexAttentionImpl

    torch.manual_seed(0)
    kv = torch.randn(2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    block_table = torch.randperm(NUM_BLOCKS - 1)[: NUM_BLOCKS // 2].add(1).int()[None]
    _, per_layer = _proposer(own_builders).build_per_group_and_layer_attn_metadata(
        _cad(block_table)
    )
    errors = {}
    for name in LAYERS:
        window = WINDOW if name in LAYERS[:2] else None
        q = torch.randn(QUERY, HEADS, HEAD_DIM)
        impl = FlexAttentionImpl(
            HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, None, window, "auto"
        )
        out = impl.forward(SimpleNamespace(), q, None, None, kv, per_layer[name],
                           torch.empty(QUERY, HEADS, HEAD_DIM))  # fmt: skip
        errors[name] = (out - _reference(q, kv, block_table, window)).abs().max().item()
    return errors


@pytest.fixture(scope="module")
def flex_available():
    pytest.importorskip("torch.nn.attention.flex_attention")
    try:
        from vllm.v1.attention.backends import flex_attention  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the vLLM build
        pytest.skip(f"vLLM's FLEX_ATTENTION backend does not import here: {exc}")


def test_full_layer_sees_whole_context_after_sliding_layers(flex_available):
    errors = _max_errors(own_builders=True)
    assert max(errors.values()) < 1e-4, errors


def test_shared_builder_truncates_the_full_layer(flex_available):
    """The defect the separate builder fixes: without it the full layer is wrong."""
    errors = _max_errors(own_builders=False)
    assert errors["d.0"] < 1e-4 and errors["d.1"] < 1e-4
    assert errors["d.2"] > 0.1, errors


def test_window_prunes_blocks_only_in_the_sliding_builder(flex_available):
    p = _proposer(own_builders=True)
    cad = _cad(torch.arange(1, 1 + NUM_BLOCKS // 2, dtype=torch.int32)[None])
    full = p.draft_attn_groups[0].get_metadata_builder().build_for_drafting(cad, 0)
    sliding = p.sliding_builders[0].build_for_drafting(replace(cad, causal=True), 0)
    sliding.sliding_window = WINDOW
    sliding.mask_mod = sliding.get_mask_mod()
    sliding.block_mask = sliding._build_block_mask_direct()  # as FlexAttentionImpl does
    assert full.block_mask.kv_num_blocks.flatten().tolist() == [6]  # 96 tokens
    assert sliding.block_mask.kv_num_blocks.flatten().tolist() == [2]
