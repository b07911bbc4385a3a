# SPDX-License-Identifier: Apache-2.0
"""CPU GDN / causal-conv1d fallbacks vs Hugging Face transformers' torch versions.

The references are transformers' own pure-torch implementations for Qwen3.5
(``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``,
``torch_causal_conv1d_update``; state layout ``[K, V]``), run per sequence.
The fallbacks take vLLM's packed, slot-indexed arguments (state ``[V, K]``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_dflash.cpu import gdn_ops as G

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

H, HV, K, V = 2, 4, 16, 8
TOL = dict(atol=2e-5, rtol=1e-4)


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _heads(x: torch.Tensor) -> torch.Tensor:
    return x.repeat_interleave(HV // H, dim=2)


def _hf_recurrent(q, k, v, g, beta, h0_vk):
    """HF recurrence for one sequence (inputs [1, T, ...]); returns o, state [V, K]."""
    o, s = hf.torch_recurrent_gated_delta_rule(
        _heads(q), _heads(k), v, g, beta, h0_vk.transpose(-1, -2)[None], True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return o, s[0].transpose(-1, -2)


@pytest.mark.parametrize("lens", [[5, 70, 1, 130], [64], [3]])
def test_chunk_matches_hf(lens):
    torch.manual_seed(0)
    t, cu = sum(lens), _cu(lens)
    q, k = torch.randn(1, t, H, K), torch.randn(1, t, H, K)
    v = torch.randn(1, t, HV, V)
    g, beta = -torch.rand(1, t, HV), torch.rand(1, t, HV)
    h0 = torch.randn(len(lens), HV, V, K) * 0.1
    o, ht = G.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True,
        cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        sl = slice(s, e)
        ro, rs = _hf_recurrent(
            q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], h0[i]
        )
        torch.testing.assert_close(o[:, sl], ro, **TOL)
        torch.testing.assert_close(ht[i], rs, **TOL)
        # and HF's own chunked form agrees (same algorithm family, per sequence)
        co, _ = hf.torch_chunk_gated_delta_rule(
            _heads(q[:, sl]), _heads(k[:, sl]), v[:, sl], g[:, sl], beta[:, sl],
            initial_state=h0[i].transpose(-1, -2)[None], output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(o[:, sl], co, **TOL)


def _gates(a, b, A_log, dt_bias):
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


@pytest.mark.parametrize("accepted", [[1, 3, 2], [4, 1, 1]])
def test_spec_verify_slots_match_hf(accepted):
    """Verify of k+1 tokens: read slot accepted-1, write the state after token t to slot t."""
    torch.manual_seed(1)
    n, kp1 = 3, 4
    lens = [kp1, kp1, 2]  # a shorter last sequence
    t, cu = sum(lens), _cu(lens)
    q, k = torch.randn(1, t, H, K), torch.randn(1, t, H, K)
    v = torch.randn(1, t, HV, V)
    a, b = torch.randn(t + 3, HV), torch.randn(t + 3, HV)  # extra rows: other tokens
    A_log, dt_bias = torch.rand(HV), torch.rand(HV)
    pool = torch.randn(20, HV, V, K) * 0.1
    slots = torch.tensor(
        [[3, 4, 5, 6], [9, 10, 11, 12], [15, 16, 0, 0]], dtype=torch.int32
    )
    acc = torch.tensor(accepted, dtype=torch.int32)
    before = pool.clone()
    o, _ = G.fused_sigmoid_gating_delta_rule_update(
        A_log=A_log, a=a, b=b, dt_bias=dt_bias, q=q, k=k, v=v, initial_state=pool,
        inplace_final_state=True, cu_seqlens=cu, ssm_state_indices=slots,
        num_accepted_tokens=acc, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    g, beta = _gates(a[:t], b[:t], A_log, dt_bias)
    written = set()
    for i in range(n):
        s, e = int(cu[i]), int(cu[i + 1])
        h0 = before[int(slots[i, int(acc[i]) - 1])]
        sl = slice(s, e)
        ro, _ = _hf_recurrent(
            q[:, sl], k[:, sl], v[:, sl], g[None, sl], beta[None, sl], h0
        )
        torch.testing.assert_close(o[:, sl], ro, **TOL)
        for j in range(e - s):  # state after token j lands in slot j
            _, rs = _hf_recurrent(
                q[:, s : s + j + 1], k[:, s : s + j + 1], v[:, s : s + j + 1],
                g[None, s : s + j + 1], beta[None, s : s + j + 1], h0,
            )  # fmt: skip
            torch.testing.assert_close(pool[int(slots[i, j])], rs, **TOL)
            written.add(int(slots[i, j]))
    untouched = [i for i in range(20) if i not in written]
    torch.testing.assert_close(pool[untouched], before[untouched], atol=0, rtol=0)


def test_decode_paths_match_hf():
    """1-token decode: the packed kernel and the sigmoid-gating kernel, 1-D slots."""
    torch.manual_seed(2)
    n = 3
    qkv = torch.randn(n, 2 * H * K + HV * V)
    a, b = torch.randn(n, HV), torch.randn(n, HV)
    A_log, dt_bias = torch.rand(HV), torch.rand(HV)
    pool = torch.randn(8, HV, V, K) * 0.1
    slots = torch.tensor([2, 0, 5], dtype=torch.int32)  # 0 = null: skipped
    before = pool.clone()
    out = torch.empty(n, 1, HV, V)
    G.fused_recurrent_gated_delta_rule_packed_decode(
        mixed_qkv=qkv, a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=K**-0.5,
        initial_state=pool, out=out, ssm_state_indices=slots,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    pool2 = before.clone()
    q = qkv[:, : H * K].reshape(1, n, H, K)
    k = qkv[:, H * K : 2 * H * K].reshape(1, n, H, K)
    v = qkv[:, 2 * H * K :].reshape(1, n, HV, V)
    o2, _ = G.fused_sigmoid_gating_delta_rule_update(
        A_log=A_log, a=a, b=b, dt_bias=dt_bias, q=q, k=k, v=v, initial_state=pool2,
        cu_seqlens=torch.arange(n + 1, dtype=torch.int32), ssm_state_indices=slots,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    g, beta = _gates(a, b, A_log, dt_bias)
    for i in (0, 2):
        sl = slice(i, i + 1)
        ro, rs = _hf_recurrent(
            q[:, sl],
            k[:, sl],
            v[:, sl],
            g[None, sl],
            beta[None, sl],
            before[int(slots[i])],
        )
        torch.testing.assert_close(out[i, 0], ro[0, 0], **TOL)
        torch.testing.assert_close(o2[0, i], ro[0, 0], **TOL)
        torch.testing.assert_close(pool[int(slots[i])], rs, **TOL)
        torch.testing.assert_close(pool2[int(slots[i])], rs, **TOL)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    keep = [0, 1, 3, 4, 6, 7]
    assert torch.equal(pool[keep], before[keep]) and torch.equal(
        pool2[keep], before[keep]
    )


def test_post_conv_prep_matches_hf_formulas():
    torch.manual_seed(3)
    n = 7
    x = torch.randn(n, 2 * H * K + HV * V)
    a, b = torch.randn(n, HV) * 10, torch.randn(n, HV)  # large a: softplus threshold
    A_log, dt_bias = torch.rand(HV), torch.rand(HV)
    q, k, v, g, beta = G.fused_post_conv_prep(x, a, b, A_log, dt_bias, H, K, V)
    torch.testing.assert_close(q, hf.l2norm(x[:, : H * K].reshape(n, H, K)), **TOL)
    torch.testing.assert_close(
        k, hf.l2norm(x[:, H * K : 2 * H * K].reshape(n, H, K)), **TOL
    )
    torch.testing.assert_close(v, x[:, 2 * H * K :].reshape(n, HV, V))
    rg, rb = _gates(a, b, A_log, dt_bias)
    torch.testing.assert_close(g, rg, **TOL)
    torch.testing.assert_close(beta, rb, **TOL)


DIM, W = 6, 4


def _hf_conv(x_dt, state_dw, weight, bias):
    """HF's stateful conv (always SiLU) for one sequence: x [dim, T], state [dim, W-1]."""
    st = state_dw.clone()[None]
    out = hf.torch_causal_conv1d_update(x_dt[None], st, weight, bias)
    return out[0], st[0]


def test_conv_fn_prefill_matches_hf():
    torch.manual_seed(4)
    lens = [1, 9, 2, 5]
    t, cu = sum(lens), _cu(lens)
    x = torch.randn(t, DIM)
    weight, bias = torch.randn(DIM, W), torch.randn(DIM)
    states = torch.randn(10, DIM, W - 1 + 3)  # room for 3 draft columns
    slots = torch.tensor([4, 7, 0, 2], dtype=torch.int32)  # 0: null, untouched
    has_init = torch.tensor([True, False, True, True])
    before = states.clone()
    out = G.causal_conv1d_fn(
        x.t(), weight, bias, states, cu, cache_indices=slots,
        has_initial_state=has_init, activation="silu",
    ).t()  # fmt: skip
    for i in (0, 1, 3):
        s, e = int(cu[i]), int(cu[i + 1])
        init = (
            before[int(slots[i]), :, : W - 1]
            if has_init[i]
            else torch.zeros(DIM, W - 1)
        )
        ro, rs = _hf_conv(x[s:e].t(), init, weight, bias)
        torch.testing.assert_close(out[s:e], ro.t(), **TOL)
        torch.testing.assert_close(states[int(slots[i]), :, : W - 1], rs, **TOL)
        torch.testing.assert_close(
            states[int(slots[i]), :, W - 1 :], before[int(slots[i]), :, W - 1 :]
        )
    assert torch.equal(states[0], before[0])


def test_conv_update_decode_matches_hf():
    torch.manual_seed(5)
    x = torch.randn(3, DIM)
    weight, bias = torch.randn(DIM, W), torch.randn(DIM)
    states = torch.randn(6, DIM, W - 1 + 2)
    slots = torch.tensor([5, 0, 1], dtype=torch.int32)
    before = states.clone()
    out = G.causal_conv1d_update(
        x.clone(), states, weight, bias, "silu", conv_state_indices=slots
    )
    for i in (0, 2):
        ro, rs = _hf_conv(
            x[i, :, None], before[int(slots[i]), :, : W - 1], weight, bias
        )
        torch.testing.assert_close(out[i], ro[:, 0], **TOL)
        torch.testing.assert_close(states[int(slots[i]), :, : W - 1], rs, **TOL)
    torch.testing.assert_close(out[1], x[1])  # null slot: x passes through
    assert torch.equal(states[0], before[0])


def test_conv_update_spec_verify():
    """Verify: window from column accepted-1; state becomes [window[1:], x]."""
    torch.manual_seed(6)
    k_spec = 3
    lens = [4, 4, 2]
    t, cu = sum(lens), _cu(lens)
    x = torch.randn(t, DIM)
    weight, bias = torch.randn(DIM, W), torch.randn(DIM)
    states = torch.randn(8, DIM, W - 1 + k_spec)
    slots = torch.tensor([1, 6, 3], dtype=torch.int32)
    acc = torch.tensor([1, 3, 4], dtype=torch.int32)
    before = states.clone()
    out = G.causal_conv1d_update(
        x.clone(), states, weight, bias, "silu", conv_state_indices=slots,
        num_accepted_tokens=acc, query_start_loc=cu, max_query_len=k_spec + 1,
    )  # fmt: skip
    for i in range(3):
        s, e = int(cu[i]), int(cu[i + 1])
        o = int(acc[i]) - 1
        window = before[int(slots[i]), :, o : o + W - 1]
        ro, _ = _hf_conv(x[s:e].t(), window, weight, bias)
        torch.testing.assert_close(out[s:e], ro.t(), **TOL)
        expect = torch.cat([window[:, 1:], x[s:e].t()], dim=1)
        n_cols = W - 2 + (e - s)
        torch.testing.assert_close(states[int(slots[i]), :, :n_cols], expect, **TOL)
        torch.testing.assert_close(
            states[int(slots[i]), :, n_cols:], before[int(slots[i]), :, n_cols:]
        )
