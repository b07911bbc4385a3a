# SPDX-License-Identifier: Apache-2.0
"""dflash_flex_hybrid_kv_layout: vLLM's real FLEX_ATTENTION backend (CPU tensors)
on the hybrid KV-cache layout.

In attention + mamba models the GPU runner re-strides each attention layer's cache
(2, N, bs, h, d) so that K and V of a block are adjacent (memory (N, 2, bs, h, d)).
Stock FLEX's forward views the cache as contiguous and raises; the patch builds the
metadata over a doubled block table and reads K/V through two row views. Here the
metadata comes from ``FlexAttentionMetadataBuilder.build`` and the output from
``FlexAttentionImpl.forward`` (compiled flex_attention on CPU), for a batch of two
requests: non-causal (DFlash's drafter), causal, and causal with a sliding window.
The interleaved case must equal the contiguous one and plain softmax attention.

flex_attention runs eagerly here (torch's dense implementation of the same op:
the mask, not the block sparsity); the block sparsity is checked on the block mask
(kv_indices of the interleaved cache = 2 x the contiguous ones). The compiled CPU
kernel (vLLM's ``flex_attention_compiled``, about 65 s of cold compilation on 2
cores, then 10 s per mask) runs with ``VLLM_DFLASH_TEST_FLEX_COMPILED=1``;
``tests/gpu/test_flex_hybrid_kv.py`` runs the same cases with the CUDA kernel.
With ``VLLM_DFLASH_DISABLE=dflash_flex_hybrid_kv_layout`` the patch is not applied
and the tests of the patched behaviour fail with the stock error.
Shapes are chosen so that both layouts hand flex_attention tensors of one shape
(the contiguous cache has 2N-1 blocks): one compilation per mask serves both.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from vllm_dflash import envs

pytestmark = pytest.mark.filterwarnings("ignore:.*without torch.compile")

BLOCK, HEADS, KV_HEADS, HEAD_DIM = 16, 4, 2, 32
N = 8  # blocks of the interleaved cache; the contiguous one has 2N-1
CONTEXT, QUERY = (30, 45), (6, 5)  # two requests: cached context, then the queries
WINDOW = 9
LAYER = "drafter.layers.0.self_attn.attn"


@pytest.fixture(scope="module")
def flex():
    pytest.importorskip("torch.nn.attention.flex_attention")
    try:
        from vllm.v1.attention.backends import flex_attention
    except Exception as exc:  # pragma: no cover - depends on the vLLM build
        pytest.skip(f"vLLM's FLEX_ATTENTION backend does not import here: {exc}")
    return flex_attention


@pytest.fixture
def patched(flex, isolated):
    from vllm_dflash.spec_decode import flex_hybrid_kv as fh

    isolated(fh.PATCH)
    assert fh.probe(), "this vLLM's FLEX forward already reads interleaved caches"
    if fh.PATCH_NAME not in envs.disabled_patches():  # disabled: the stock code runs
        fh.apply()
        fh.apply()  # idempotent
    assert fh.probe()  # the probe asks the unpatched forward
    return fh


@pytest.fixture
def eager_flex(flex, monkeypatch):
    """torch's eager flex_attention in place of vLLM's compiled one (CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(flex, "flex_attention_compiled", flex_attention)


def caches(device="cpu"):
    """The same K/V per physical block, contiguous (2N-1 blocks) and interleaved."""
    torch.manual_seed(0)
    contiguous = torch.randn(2, 2 * N - 1, BLOCK, KV_HEADS, HEAD_DIM, device=device)
    pages = torch.empty(N, 2, BLOCK, KV_HEADS, HEAD_DIM, device=device)  # as the runner
    pages.copy_(contiguous[:, :N].transpose(0, 1))
    interleaved = pages.transpose(0, 1)
    hidden = BLOCK * KV_HEADS * HEAD_DIM
    assert interleaved.stride()[:2] == (hidden, 2 * hidden)
    return contiguous, interleaved


def _block_table() -> torch.Tensor:
    """Physical blocks 1..N-1 (0 is the null block), shuffled, split over the requests."""
    blocks = (
        torch.randperm(N - 1, generator=torch.Generator().manual_seed(1)) + 1
    ).int()
    need = [-(-(c + q) // BLOCK) for c, q in zip(CONTEXT, QUERY, strict=True)]
    assert sum(need) <= N - 1
    table = torch.zeros(2, N, dtype=torch.int32)
    table[0, : need[0]] = blocks[: need[0]]
    table[1, : need[1]] = blocks[need[0] : sum(need)]
    table[0, need[0] :] = blocks[need[0]]  # stale entries (another request's block)
    return table


def builder(flex, num_gpu_blocks: int, kv_cache: torch.Tensor | None, device="cpu"):
    """A FLEX metadata builder whose layer the runner bound to ``kv_cache``."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    model = SimpleNamespace(
        get_num_attention_heads=lambda p: HEADS, get_num_kv_heads=lambda p: KV_HEADS,
        get_head_size=lambda: HEAD_DIM, max_model_len=256, dtype=torch.float32,
    )  # fmt: skip
    layers = {} if kv_cache is None else {LAYER: SimpleNamespace(kv_cache=kv_cache)}
    cfg = SimpleNamespace(
        model_config=model, parallel_config=None,
        cache_config=SimpleNamespace(num_gpu_blocks=num_gpu_blocks),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64),
        compilation_config=SimpleNamespace(cudagraph_mode=None,
                                           static_forward_context=layers),
    )  # fmt: skip
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32
    )
    return flex.FlexAttentionMetadataBuilder(spec, [LAYER], cfg, torch.device(device))


def _common(causal: bool, device):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    seq_lens = torch.tensor(
        [c + q for c, q in zip(CONTEXT, QUERY, strict=True)], dtype=torch.int32
    )
    qsl = torch.tensor([0, QUERY[0], sum(QUERY)], dtype=torch.int32)
    table = _block_table()
    pos = torch.cat(
        [torch.arange(c, c + q) for c, q in zip(CONTEXT, QUERY, strict=True)]
    )
    req = torch.repeat_interleave(torch.arange(2), torch.tensor(QUERY))
    slots = table[req, pos // BLOCK].long() * BLOCK + pos % BLOCK
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl,
        seq_lens=seq_lens.to(device), num_reqs=2, num_actual_tokens=sum(QUERY),
        max_query_len=max(QUERY), max_seq_len=int(seq_lens.max()),
        block_table_tensor=table.to(device), slot_mapping=slots.to(device),
        causal=causal,
    )  # fmt: skip


def forward(flex, b, kv_cache, q, causal: bool, window: int | None):
    """FlexAttentionImpl.forward over metadata from ``b.build``."""
    meta = b.build(0, _common(causal, q.device))
    impl = flex.FlexAttentionImpl(
        HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, None, window, "auto"
    )
    layer = SimpleNamespace(layer_name=LAYER)
    out = torch.zeros(sum(QUERY), HEADS, HEAD_DIM, device=q.device)
    return impl.forward(layer, q, None, None, kv_cache, meta, out), meta


def reference(contiguous, q, causal: bool, window: int | None) -> torch.Tensor:
    """Softmax attention of each request's queries over its logical K/V (float64)."""
    table, outs, start = _block_table(), [], 0
    contiguous, q = contiguous.double().cpu(), q.double().cpu()
    for r, (ctx, ql) in enumerate(zip(CONTEXT, QUERY, strict=True)):
        pos = torch.arange(ctx + ql)
        slots = table[r, pos // BLOCK].long() * BLOCK + pos % BLOCK
        k, v = (
            c.reshape(-1, KV_HEADS, HEAD_DIM)[slots].repeat_interleave(
                HEADS // KV_HEADS, 1
            )
            for c in contiguous
        )
        qpos = torch.arange(ctx, ctx + ql)[:, None]
        allowed = torch.ones(ql, ctx + ql, dtype=torch.bool)
        if causal:
            allowed &= pos[None] <= qpos
        if window is not None:
            allowed &= (qpos - pos[None]).abs() < window
        scores = torch.einsum("qhd,khd->hqk", q[start : start + ql], k) * HEAD_DIM**-0.5
        probs = scores.masked_fill(~allowed, -torch.inf).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
        start += ql
    return torch.cat(outs).float()


CASES = [(False, None), (True, None), (True, WINDOW)]  # DFlash drafter, causal, SWA


def check_hybrid_layout(flex, interleaved_attr: str, device="cpu") -> None:
    """Both layouts through build + forward: equal, and equal to the reference."""
    contiguous, interleaved = caches(device)
    stock = builder(flex, 2 * N - 1, contiguous, device)
    hybrid = builder(flex, N, interleaved, device)
    ptr = interleaved.data_ptr()
    for causal, window in CASES:
        q = torch.randn(sum(QUERY), HEADS, HEAD_DIM, device=device)
        want, meta_c = forward(flex, stock, contiguous, q, causal, window)
        got, meta_i = forward(flex, hybrid, interleaved, q, causal, window)
        ref = reference(contiguous, q, causal, window)
        case = f"causal={causal} window={window}"
        assert (want.cpu() - ref).abs().max() < 1e-4, case
        assert (got.cpu() - ref).abs().max() < 1e-4, case
        assert torch.allclose(got, want, atol=1e-5), case
        # The mapping: block p of the cache is block 2p of the doubled one; the
        # odd (V) blocks map to no logical block and the kernel never loads them.
        assert meta_i.num_blocks == meta_c.num_blocks == 2 * N - 1
        kv_i = meta_i.block_mask.kv_indices
        kv_c = meta_c.block_mask.kv_indices
        assert torch.equal(kv_i[kv_i >= 0], 2 * kv_c[kv_c >= 0]), case
        assert torch.equal(
            meta_i.block_mask.kv_num_blocks, meta_c.block_mask.kv_num_blocks
        )
        assert (meta_i.physical_to_logical[:, 1::2] == -1).all()
        assert getattr(meta_i, interleaved_attr) is True
        assert not getattr(meta_c, interleaved_attr, False)
    assert interleaved.data_ptr() == ptr  # read in place, never copied


def check_stock_defect(flex, device="cpu") -> None:
    """The stock forward cannot read the interleaved cache."""
    _, interleaved = caches(device)
    q = torch.randn(sum(QUERY), HEADS, HEAD_DIM, device=device)
    with pytest.raises(RuntimeError, match="view size is not compatible") as e:
        forward(
            flex, builder(flex, N, interleaved, device), interleaved, q, False, None
        )
    return e.value


def test_flex_reads_the_hybrid_layout(flex, patched, eager_flex):
    check_hybrid_layout(flex, patched.INTERLEAVED_ATTR)


@pytest.mark.skipif(
    os.environ.get("VLLM_DFLASH_TEST_FLEX_COMPILED") != "1",
    reason="compiled CPU flex kernel: VLLM_DFLASH_TEST_FLEX_COMPILED=1 (about 100 s cold)",
)
def test_flex_reads_the_hybrid_layout_compiled_kernel(flex, patched):
    check_hybrid_layout(flex, patched.INTERLEAVED_ATTR)


def test_stock_flex_cannot_read_the_hybrid_layout(flex, isolated, eager_flex):
    """The defect (patch off): the stock forward raises at the first layer."""
    from vllm_dflash.spec_decode import flex_hybrid_kv as fh

    isolated(fh.PATCH)  # stock classes, even where the patch was applied before
    for cls, name in ((flex.FlexAttentionMetadataBuilder, "build"),
                      (flex.FlexAttentionImpl, "forward")):  # fmt: skip
        setattr(cls, name, fh.original(getattr(cls, name)))
    check_stock_defect(flex)


def test_metadata_and_cache_must_agree(flex, patched, eager_flex):
    """A builder that cannot see its layer's cache builds for the contiguous
    layout: forward refuses the interleaved cache instead of reading garbage."""
    _, interleaved = caches()
    q = torch.randn(sum(QUERY), HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="metadata built for a contiguous"):
        forward(flex, builder(flex, N, None), interleaved, q, False, None)


def test_apply_changes_both_declared_targets(flex, patched):
    """What test_patch_records checks on CUDA (the patch is CUDA-only)."""
    from vllm_dflash.registry import is_patched

    if patched.PATCH_NAME in envs.disabled_patches():
        pytest.skip("disabled")
    assert is_patched(flex.FlexAttentionMetadataBuilder.build, patched.PATCH_NAME)
    assert is_patched(flex.FlexAttentionImpl.forward, patched.PATCH_NAME)
