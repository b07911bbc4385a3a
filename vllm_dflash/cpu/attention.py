# SPDX-License-Identifier: Apache-2.0
"""CPU defects 5 and 6: DFlash draft attention on ``CPU_ATTN``.

5. ``CPUAttentionBackendImpl`` has no ``do_kv_cache_update``; DFlash writes the
   precomputed context K/V through it. The CPU cache layout depends on the ISA,
   so the write goes through ``cpu_attn_reshape_and_cache`` with the same ISA
   string the metadata builder picks.
6. ``cpu_attention_with_kv_cache(causal=False)`` is wrong when the query has a
   prefix in the cache. Non-causal attention in which every query token sees all
   keys of its request equals causal attention run with one query per row (each
   row: the request's block table, its full seq_len, query length 1). The
   metadata builder expands non-causal batches that way (vectorised); the
   metadata still reports ``causal=False`` (as DFlash requires) and the kernel
   is called with ``causal=True`` on the expanded rows.
"""

import inspect
from dataclasses import replace
from types import SimpleNamespace

import torch

from vllm_dflash.registry import (
    CPU_ONLY,
    V020,
    Patch,
    PatchKind,
    original,
    replace_attr,
)

KV_UPDATE_NAME = "cpu_attn_kv_cache_update"
NONCAUSAL_NAME = "cpu_attn_exact_noncausal"
_ROWS = "_vllm_dflash_noncausal_rows"


def split_kv_cache(
    kv_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(key_cache, value_cache, block_size, head_size) for both CPU layouts.

    vLLM <= 0.22: [2, blocks, kv_heads, block_size, head_size];
    vLLM 0.23:    [blocks, kv_heads, block_size, 2 * head_size], which its
    forward views as [blocks, kv_heads, 2 * block_size, head_size] and chunks.
    """
    if kv_cache.dim() == 5:
        key_cache, value_cache = kv_cache.unbind(0)
        return key_cache, value_cache, kv_cache.shape[3], kv_cache.shape[4]
    blocks, heads, block_size, two_hd = kv_cache.shape
    view = kv_cache.view(blocks, heads, 2 * block_size, two_hd // 2)
    key_cache, value_cache = view.chunk(2, dim=2)
    return key_cache, value_cache, block_size, two_hd // 2


def get_isa(dtype: torch.dtype, block_size: int, head_size: int, kv_dtype: str) -> str:
    """The ISA string the metadata builder picks (signature differs by version)."""
    from vllm.v1.attention.backends import cpu_attn

    params = inspect.signature(cpu_attn._get_attn_isa).parameters
    if "kv_cache_dtype" in params:
        return cpu_attn._get_attn_isa(dtype, block_size, head_size, kv_dtype)
    return cpu_attn._get_attn_isa(dtype, block_size, head_size)


def probe_kv_update() -> bool:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    return not hasattr(CPUAttentionBackendImpl, "do_kv_cache_update")


def apply_kv_update() -> None:
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        key_cache, value_cache, block_size, head_size = split_kv_cache(kv_cache)
        kv_dtype = getattr(self, "kv_cache_dtype", "auto")
        isa = get_isa(kv_cache.dtype, block_size, head_size, kv_dtype)
        n = slot_mapping.shape[0]
        kwargs = {}
        if kv_dtype != "auto" and layer is not None:
            kwargs = {
                "k_scale": layer._k_scale_float,
                "v_scale": layer._v_scale_float,
                "kv_cache_dtype": kv_dtype,
            }
        ops.cpu_attn_reshape_and_cache(
            key[:n], value[:n], key_cache, value_cache, slot_mapping, isa, **kwargs
        )

    replace_attr(
        cpu_attn.CPUAttentionBackendImpl,
        "do_kv_cache_update",
        do_kv_cache_update,
        KV_UPDATE_NAME,
        add=True,
    )


def expand_noncausal_rows(cad):
    """One causal row of query length 1 per query token, full seq_len each."""
    num_reqs = cad.num_reqs
    qsl = cad.query_start_loc[: num_reqs + 1]
    q_lens = qsl[1:] - qsl[:-1]
    num_rows = int(qsl[-1])
    rows_qsl = torch.arange(num_rows + 1, dtype=qsl.dtype)
    return replace(
        cad,
        query_start_loc=rows_qsl,
        query_start_loc_cpu=rows_qsl,
        seq_lens=torch.repeat_interleave(cad.seq_lens[:num_reqs], q_lens),
        num_reqs=num_rows,
        max_query_len=1,
        block_table_tensor=torch.repeat_interleave(
            cad.block_table_tensor[:num_reqs], q_lens, dim=0
        ),
        causal=True,
        _seq_lens_cpu=None,
        _num_computed_tokens_cpu=None,
        seq_lens_cpu_upper_bound=None,
    )


def noncausal_error(build=None, forward=None) -> float:
    """Max error of CPU attention for a DFlash-shaped non-causal block.

    One request with 20 context keys already in the cache (two blocks) and a
    5-token query block; every query token must see all 25 keys. ``build``/``forward``
    default to vLLM's unpatched metadata builder and attention forward.
    """
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends import cpu_attn

    build = build or original(cpu_attn.CPUAttentionMetadataBuilder.build)
    forward = forward or original(cpu_attn.CPUAttentionBackendImpl.forward)
    heads, kv_heads, head, block, ctx, q_len = 2, 1, 32, 16, 20, 5
    g = torch.Generator().manual_seed(0)
    shape = cpu_attn.CPUAttentionBackend.get_kv_cache_shape(3, block, kv_heads, head)
    kv_cache = torch.zeros(shape)
    table = torch.tensor([[2, 1]], dtype=torch.int32)  # a non-trivial block table
    slots = (table[0, torch.arange(ctx + q_len) // block].long() * block) + (
        torch.arange(ctx + q_len) % block
    )
    k, v = (torch.randn(ctx + q_len, kv_heads, head, generator=g) for _ in range(2))
    q = torch.randn(q_len, heads, head, generator=g)
    key_cache, value_cache, _, _ = split_kv_cache(kv_cache)
    from vllm import _custom_ops as ops

    isa = get_isa(torch.float32, block, head, "auto")
    ops.cpu_attn_reshape_and_cache(
        k[:ctx], v[:ctx], key_cache, value_cache, slots[:ctx], isa
    )
    qsl = torch.tensor([0, q_len], dtype=torch.int32)
    cad = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl,
        seq_lens=torch.tensor([ctx + q_len], dtype=torch.int32), num_reqs=1,
        num_actual_tokens=q_len, max_query_len=q_len, max_seq_len=ctx + q_len,
        block_table_tensor=table, slot_mapping=slots[ctx:], causal=False,
    )  # fmt: skip
    builder = object.__new__(cpu_attn.CPUAttentionMetadataBuilder)
    builder.__dict__.update(
        use_sdpa_prefill=False, reorder_batch_threshold=None, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head, dtype=torch.float32, window_size=-1,
        block_size=block, isa=isa, is_cross_attention=False,
    )  # fmt: skip
    impl = cpu_attn.CPUAttentionBackendImpl(
        heads, head, head**-0.5, kv_heads, None, None, "auto"
    )
    out = torch.zeros_like(q)
    layer = SimpleNamespace(  # what newer CPU forwards read from the layer
        _k_scale_float=1.0, _v_scale_float=1.0,
        _k_scale=torch.ones(()), _v_scale=torch.ones(()),
    )  # fmt: skip
    forward(impl, layer, q, k[ctx:], v[ctx:], kv_cache, build(builder, 0, cad), out)
    kk = k.double().repeat_interleave(heads // kv_heads, 1)
    vv = v.double().repeat_interleave(heads // kv_heads, 1)
    p = (torch.einsum("qhd,khd->hqk", q.double(), kk) * head**-0.5).softmax(-1)
    want = torch.einsum("hqk,khd->qhd", p, vv)
    return (out.double() - want).abs().max().item()


def probe_noncausal() -> bool:
    """Ask vLLM's CPU attention for a non-causal block over a cached prefix."""
    return noncausal_error() > 1e-3


def apply_noncausal() -> None:
    from vllm.v1.attention.backends import cpu_attn

    stock_build = original(cpu_attn.CPUAttentionMetadataBuilder.build)
    stock_forward = original(cpu_attn.CPUAttentionBackendImpl.forward)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        if common_attn_metadata.causal or self.is_cross_attention:
            return stock_build(
                self, common_prefix_len, common_attn_metadata, fast_build
            )
        rows = expand_noncausal_rows(common_attn_metadata)
        md = stock_build(self, common_prefix_len, rows, fast_build)
        md.causal = False
        setattr(md, _ROWS, True)
        return md

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs
    ):
        rows = attn_metadata is not None and getattr(attn_metadata, _ROWS, False)
        if rows:
            attn_metadata.causal = True  # rows of length 1: causal == sees all keys
        try:
            return stock_forward(
                self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs
            )
        finally:
            if rows:
                attn_metadata.causal = False

    replace_attr(cpu_attn.CPUAttentionMetadataBuilder, "build", build, NONCAUSAL_NAME)
    replace_attr(cpu_attn.CPUAttentionBackendImpl, "forward", forward, NONCAUSAL_NAME)


KV_UPDATE_PATCH = Patch(
    name=KV_UPDATE_NAME,
    kind=PatchKind.CPU,
    targets=(
        "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.do_kv_cache_update",
    ),
    summary="CPU attention gets do_kv_cache_update (ISA-specific cache layout).",
    why="DFlash inserts precomputed context K/V through do_kv_cache_update.",
    upstream="none, CPU backend defect",
    versions=V020,
    platforms=CPU_ONLY,
    probe=probe_kv_update,
    apply=apply_kv_update,
    future="Send upstream.",
)

NONCAUSAL_PATCH = Patch(
    name=NONCAUSAL_NAME,
    kind=PatchKind.CPU,
    targets=(
        "vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder.build",
        "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward",
    ),
    summary="Exact non-causal attention on CPU: one causal query row per block token.",
    why="cpu_attention_with_kv_cache(causal=False) is wrong with a cached prefix.",
    upstream="none, CPU backend defect",
    versions=V020,
    platforms=CPU_ONLY,
    probe=probe_noncausal,
    apply=apply_noncausal,
    future="Report the kernel bug upstream; drop when the kernel is exact.",
)
