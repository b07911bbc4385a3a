# SPDX-License-Identifier: Apache-2.0
"""CPU defects 5 and 6 at kernel level: context K/V insert and exact draft attention."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import restore_after
from vllm_dflash.cpu import attention as cpu_attention
from vllm_dflash.registry import original

pytest.importorskip("vllm")
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends import cpu_attn  # noqa: E402

NH, NKV, HD = 4, 2, 32


@pytest.fixture(scope="module", autouse=True)
def _patched():
    with pytest.MonkeyPatch.context() as mp:
        restore_after(mp, cpu_attention.KV_UPDATE_PATCH)
        restore_after(mp, cpu_attention.NONCAUSAL_PATCH)
        if not hasattr(cpu_attn.CPUAttentionBackendImpl, "do_kv_cache_update"):
            cpu_attention.apply_kv_update()
        cpu_attention.apply_noncausal()
        yield


def _builder(block_size: int) -> cpu_attn.CPUAttentionMetadataBuilder:
    b = object.__new__(cpu_attn.CPUAttentionMetadataBuilder)
    b.__dict__.update(
        use_sdpa_prefill=False,
        reorder_batch_threshold=None,
        num_heads=NH,
        num_kv_heads=NKV,
        head_dim=HD,
        dtype=torch.float32,
        window_size=-1,  # DFlash keeps full-size KV for every drafter layer
        block_size=block_size,
        isa=cpu_attn._get_attn_isa(torch.float32, block_size, HD),
        is_cross_attention=False,
    )
    return b


def _exact(q, k_all, v_all, q_pos, k_pos, window=None, causal=False):
    q, k_all, v_all = q.double(), k_all.double(), v_all.double()
    rep = NH // NKV
    k_all, v_all = k_all.repeat_interleave(rep, 1), v_all.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, k_all) * HD**-0.5
    allowed = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    if causal:
        allowed &= k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v_all)


def _scenario(block_size: int, ctx_lens=(20, 7), q_len=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = 4
    n_blocks = blocks_per_req * len(ctx_lens) + 1
    kv_cache = torch.zeros(2, n_blocks, NKV, block_size, HD)
    # Request r owns blocks 1 + r*4 .. : a non-trivial table.
    table = torch.tensor(
        [
            [1 + r * blocks_per_req + b for b in range(blocks_per_req)][::-1]
            for r in range(len(ctx_lens))
        ],
        dtype=torch.int32,
    )

    def slots(r, pos):
        return (
            table[r, pos // block_size].long() * block_size + pos % block_size
        ).long()

    impl = cpu_attn.CPUAttentionBackendImpl(NH, HD, HD**-0.5, NKV, None, None, "auto")
    reqs = []
    for r, c in enumerate(ctx_lens):
        ck, cv = (
            torch.randn(c, NKV, HD, generator=g),
            torch.randn(c, NKV, HD, generator=g),
        )
        impl.do_kv_cache_update(None, ck, cv, kv_cache, slots(r, torch.arange(c)))
        q = torch.randn(q_len, NH, HD, generator=g)
        qk, qv = (
            torch.randn(q_len, NKV, HD, generator=g),
            torch.randn(q_len, NKV, HD, generator=g),
        )
        reqs.append((c, ck, cv, q, qk, qv))
    q_pos = [torch.arange(c, c + q_len) for c, *_ in reqs]
    qsl = torch.arange(len(reqs) + 1, dtype=torch.int32) * q_len
    seq_lens = torch.tensor([c + q_len for c, *_ in reqs], dtype=torch.int32)
    slot_mapping = torch.cat([slots(r, p) for r, p in enumerate(q_pos)])

    def cad(causal: bool) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens,
            num_reqs=len(reqs), num_actual_tokens=int(qsl[-1]), max_query_len=q_len,
            max_seq_len=int(seq_lens.max()), block_table_tensor=table,
            slot_mapping=slot_mapping, causal=causal,
        )  # fmt: skip

    return kv_cache, reqs, q_pos, cad


def _run(impl, md, kv_cache, reqs):
    q = torch.cat([r[3] for r in reqs])
    k = torch.cat([r[4] for r in reqs])
    v = torch.cat([r[5] for r in reqs])
    out = torch.zeros_like(q)
    impl.forward(None, q, k, v, kv_cache, md, out)
    return out


def _want(reqs, q_pos, window=None, causal=False):
    outs = []
    for (c, ck, cv, q, qk, qv), qp in zip(reqs, q_pos, strict=True):
        k_all, v_all = torch.cat([ck, qk]), torch.cat([cv, qv])
        outs.append(
            _exact(q, k_all, v_all, qp, torch.arange(c + len(qp)), window, causal)
        )
    return torch.cat(outs)


@pytest.mark.parametrize("block_size", [16, 128])
def test_noncausal_block_is_exact(block_size):
    kv_cache, reqs, q_pos, cad = _scenario(block_size)
    impl = cpu_attn.CPUAttentionBackendImpl(NH, HD, HD**-0.5, NKV, None, None, "auto")
    md = _builder(block_size).build(0, cad(causal=False))
    assert md.causal is False  # what DFlashProposer checks
    got = _run(impl, md, kv_cache, reqs)
    err = (got.double() - _want(reqs, q_pos)).abs().max().item()
    assert err < 1e-4, err


@pytest.mark.parametrize("block_size", [16, 128])
def test_stock_noncausal_kernel_is_wrong(block_size):
    """Documents defect 6 on 0.20.1: what the patch works around."""
    kv_cache, reqs, q_pos, cad = _scenario(block_size)
    impl = cpu_attn.CPUAttentionBackendImpl(NH, HD, HD**-0.5, NKV, None, None, "auto")
    stock_build = original(cpu_attn.CPUAttentionMetadataBuilder.build)
    md = stock_build(_builder(block_size), 0, cad(causal=False))
    got = _run(impl, md, kv_cache, reqs)
    err = (got.double() - _want(reqs, q_pos)).abs().max().item()
    assert err > 1e-2, "stock CPU non-causal attention became exact: re-check the probe"


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("window", [3, 6])
def test_sliding_window_causal_is_exact(block_size, window):
    kv_cache, reqs, q_pos, cad = _scenario(block_size)
    impl = cpu_attn.CPUAttentionBackendImpl(NH, HD, HD**-0.5, NKV, None, window, "auto")
    md = _builder(block_size).build(0, cad(causal=True))
    got = _run(impl, md, kv_cache, reqs)
    err = (
        (got.double() - _want(reqs, q_pos, window=window, causal=True))
        .abs()
        .max()
        .item()
    )
    assert err < 1e-4, err


def test_context_kv_insert_reads_back_like_reshape_and_cache():
    """do_kv_cache_update writes the ISA layout the attention kernel reads."""
    kv_cache, reqs, q_pos, cad = _scenario(16, ctx_lens=(9,), q_len=1)
    impl = cpu_attn.CPUAttentionBackendImpl(NH, HD, HD**-0.5, NKV, None, None, "auto")
    md = _builder(16).build(0, cad(causal=True))
    got = _run(impl, md, kv_cache, reqs)  # one query: attends to all 10 keys
    err = (got.double() - _want(reqs, q_pos, causal=True)).abs().max().item()
    assert err < 1e-4, err


def test_noncausal_probe_asks_the_kernel(monkeypatch):
    """The probe measures vLLM's attention: wrong stock kernel -> needed; a vLLM
    whose non-causal path is exact (here: the patched one) -> not needed."""
    assert cpu_attention.noncausal_error() > 1e-2
    assert cpu_attention.probe_noncausal() is True
    exact = (
        cpu_attn.CPUAttentionMetadataBuilder.build,
        cpu_attn.CPUAttentionBackendImpl.forward,
    )
    assert cpu_attention.noncausal_error(*exact) < 1e-4
    monkeypatch.setattr(cpu_attention, "original", lambda obj: obj)  # "upstream fixed"
    assert cpu_attention.probe_noncausal() is False
