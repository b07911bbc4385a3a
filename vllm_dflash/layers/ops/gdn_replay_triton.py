# SPDX-License-Identifier: Apache-2.0
"""Triton kernels of the Gated-DeltaNet state replay (see ``gdn_replay``).

One program per (value-block, sequence x value-head), the state tile ``[BV, K]``
in registers, as vLLM's recurrent kernel (``BV`` narrower at small batches:
``value_block``); both kernels skip rows whose state slot
is the null block. ``verify`` computes the outputs as vLLM's speculative verify
does (the same delta-rule step, ``_delta_step``) and stores each token's raw
inputs instead of ``1 + k`` states (a one-token verify stores the state after
its token instead: that token is always kept); ``commit`` advances the state over
the accepted records with the same step. Records of a key head are written by the
first value head of its group and the first value block only; ``a``/``b`` by
the first value block; the flag by one program per row.
"""

from __future__ import annotations

import torch
from vllm.triton_utils import tl, triton

from vllm_dflash.layers.ops.gdn_replay import Gates, RingLayout


@triton.jit
def _delta_step(
    b_h, b_k, b_v, b_a, b_b, b_decay, b_dt, threshold, L2NORM: tl.constexpr
):
    """One token of the gated delta rule on the state tile ``b_h [BV, BK]``
    (float32), as vLLM's recurrent kernel computes it; returns the new tile and
    the normalised key."""
    x = b_a + b_dt
    soft = tl.where(x <= threshold, tl.log(1 + tl.exp(x)), x)
    b_g = b_decay * soft
    b_beta = tl.sigmoid(b_b)
    if L2NORM:
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    b_h *= tl.exp(b_g)
    b_v -= tl.sum(b_h * b_k[None, :], 1)
    b_v *= b_beta
    b_h += b_v[:, None] * b_k[None, :]
    return b_h, b_k


@triton.jit
def _commit_kernel(
    A_log,
    dt_bias,
    state,
    ring,
    indices,
    num_accepted,
    threshold,
    stride_state,
    stride_ring,
    stride_indices,
    R: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    K_OFF: tl.constexpr,
    V_OFF: tl.constexpr,
    A_OFF: tl.constexpr,
    B_OFF: tl.constexpr,
    L2NORM: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    slot = tl.load(indices + i_n * stride_indices).to(tl.int64)
    if slot <= 0:
        return
    base = ring + slot * stride_ring
    if tl.load(base).to(tl.float32) <= 0:
        return
    count = tl.minimum(tl.load(num_accepted + i_n).to(tl.int32), R)
    if count <= 0:
        return
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_v[:, None] & mask_k[None, :]
    p_h = state + slot * stride_state + i_hv * V * K + o_v[:, None] * K + o_k[None, :]
    b_h = tl.load(p_h, mask=mask_h, other=0).to(tl.float32)
    b_decay = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    b_dt = tl.load(dt_bias + i_hv).to(tl.float32)
    # record j + 1 is loaded while record j is applied: the loads leave the
    # recurrence's critical path (the arithmetic is unchanged)
    n_k = tl.load(base + K_OFF + i_h * K + o_k, mask=mask_k, other=0)
    n_v = tl.load(base + V_OFF + i_hv * V + o_v, mask=mask_v, other=0)
    n_a = tl.load(base + A_OFF + i_hv)
    n_b = tl.load(base + B_OFF + i_hv)
    for j in range(0, count):
        b_k, b_v, b_a, b_b = n_k, n_v, n_a, n_b
        nxt = j + 1 < count
        n_k = tl.load(
            base + K_OFF + ((j + 1) * H + i_h) * K + o_k, mask=mask_k & nxt, other=0
        )
        n_v = tl.load(
            base + V_OFF + ((j + 1) * HV + i_hv) * V + o_v, mask=mask_v & nxt, other=0
        )
        n_a = tl.load(base + A_OFF + (j + 1) * HV + i_hv, mask=nxt, other=0)
        n_b = tl.load(base + B_OFF + (j + 1) * HV + i_hv, mask=nxt, other=0)
        b_h, b_k = _delta_step(
            b_h, b_k.to(tl.float32), b_v.to(tl.float32), b_a.to(tl.float32),
            b_b.to(tl.float32), b_decay, b_dt, threshold, L2NORM,
        )  # fmt: skip
    tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=mask_h)


@triton.jit
def _verify_kernel(
    A_log,
    a,
    b,
    dt_bias,
    q,
    k,
    v,
    o,
    state,
    ring,
    cu_seqlens,
    slots,
    scale,
    threshold,
    stride_state,
    stride_ring,
    stride_slots,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    R: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    K_OFF: tl.constexpr,
    V_OFF: tl.constexpr,
    A_OFF: tl.constexpr,
    B_OFF: tl.constexpr,
    L2NORM: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    seq_len = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    if seq_len <= 0:
        return
    slot = tl.load(slots + i_n * stride_slots).to(tl.int64)
    if slot <= 0:
        return
    base = ring + slot * stride_ring
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_v[:, None] & mask_k[None, :]
    p_h = state + slot * stride_state + i_hv * V * K + o_v[:, None] * K + o_k[None, :]
    b_h = tl.load(p_h, mask=mask_h, other=0).to(tl.float32)
    b_decay = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    b_dt = tl.load(dt_bias + i_hv).to(tl.float32)
    n_tok = tl.minimum(seq_len, R)
    # a one-token verify (a step without drafts) keeps its only token: the state
    # after it is stored in place and nothing is recorded (the flag says so)
    records = n_tok > 1
    writes_key = (i_v == 0) & (i_hv % (HV // H) == 0) & records
    writes_gate = (i_v == 0) & records
    ring_ty = ring.dtype.element_ty
    # token t + 1's inputs are loaded while token t is computed: the loads leave
    # the recurrence's critical path (the arithmetic is unchanged)
    # q, k, v: strided views of the layer's packed qkv (token and head strides)
    p_q = q + bos * stride_qt + i_h * stride_qh + o_k
    p_k = k + bos * stride_kt + i_h * stride_kh + o_k
    p_v = v + bos * stride_vt + i_hv * stride_vh + o_v
    n_q = tl.load(p_q, mask=mask_k, other=0)
    n_k = tl.load(p_k, mask=mask_k, other=0)
    n_v = tl.load(p_v, mask=mask_v, other=0)
    n_a = tl.load(a + bos * HV + i_hv)
    n_b = tl.load(b + bos * HV + i_hv)
    for t in range(0, n_tok):
        tok = bos + t
        r_q, r_k, r_v, r_a, r_b = n_q, n_k, n_v, n_a, n_b
        nxt = t + 1 < n_tok
        p_q += stride_qt
        p_k += stride_kt
        p_v += stride_vt
        n_q = tl.load(p_q, mask=mask_k & nxt, other=0)
        n_k = tl.load(p_k, mask=mask_k & nxt, other=0)
        n_v = tl.load(p_v, mask=mask_v & nxt, other=0)
        n_a = tl.load(a + (tok + 1) * HV + i_hv, mask=nxt, other=0)
        n_b = tl.load(b + (tok + 1) * HV + i_hv, mask=nxt, other=0)
        b_h, _ = _delta_step(
            b_h, r_k.to(tl.float32), r_v.to(tl.float32), r_a.to(tl.float32),
            r_b.to(tl.float32), b_decay, b_dt, threshold, L2NORM,
        )  # fmt: skip
        b_q = r_q.to(tl.float32)
        if L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
        b_q = b_q * scale
        b_o = tl.sum(b_h * b_q[None, :], 1)
        tl.store(
            o + (tok * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v
        )
        tl.store(
            base + V_OFF + (t * HV + i_hv) * V + o_v, r_v.to(ring_ty),
            mask=mask_v & records,
        )  # fmt: skip
        if writes_gate:
            tl.store(base + A_OFF + t * HV + i_hv, r_a.to(ring_ty))
            tl.store(base + B_OFF + t * HV + i_hv, r_b.to(ring_ty))
        if writes_key:
            tl.store(
                base + K_OFF + (t * H + i_h) * K + o_k, r_k.to(ring_ty), mask=mask_k
            )
    if n_tok <= 1:
        tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=mask_h)
    if (i_v == 0) & (i_hv == 0):
        flag = tl.where(records, 1.0, 0.0)
        tl.store(base, flag.to(ring_ty))


# Launch configurations (num_warps, num_stages); benchmarks/gpu/gdn_paths.py times others.
# One warp per program, as vLLM's packed decode kernel: on the H200 with the 27B
# shapes at 256 requests (48 layers) the verify of 1 token took 6.6 ms against 9.5
# with 4 warps, of 4 tokens 16.1 against 25.2; the commit 10.2 against 10.8
# (benchmarks/results/h200-2026-12-03-708200d).
COMMIT_LAUNCH = (1, 2)
VERIFY_LAUNCH = (1, 3)


# Value-block width: each program holds a ``[BV, K]`` state tile. 32 where the
# grid fills the GPU; at one request the grid of 32-wide blocks (27B shapes: 4 x 48
# one-warp programs) leaves most SMs idle while each program's token loop is
# latency-bound, so the tile narrows until the grid has ``MIN_PROGRAMS`` programs.
# Measured on an H100 (benchmarks/results/h100-2026-12-07-b372ba7, 48 layers, 16
# tokens): one request 0.84 ms at 32, 0.67 at 16, 0.91 at 8; two requests 0.86 at
# 32, 0.92 at 16. Value rows are independent in the delta rule: the width changes
# the work split, not the arithmetic of a row.
MIN_PROGRAMS = 384
BV_CHOICES = (32, 16, 8)


def value_block(layout: RingLayout, rows: int) -> int:
    """The value-block width for ``rows`` sequences (a captured graph's batch
    size is fixed, so each graph keeps one width)."""
    top = 1 << max(0, layout.head_v_dim - 1).bit_length()  # next power of two
    for bv in BV_CHOICES:
        bv = min(bv, top)
        blocks = -(-layout.head_v_dim // bv)
        if rows * layout.num_v_heads * blocks >= MIN_PROGRAMS:
            return bv
    return min(BV_CHOICES[-1], top)


def _blocks(layout: RingLayout, rows: int, bv: int | None) -> tuple[int, int, int]:
    bk = triton.next_power_of_2(layout.head_k_dim)
    bv = bv or value_block(layout, rows)
    return bk, bv, triton.cdiv(layout.head_v_dim, bv)


def _offsets(layout: RingLayout) -> dict:
    return dict(
        R=layout.records,
        H=layout.num_k_heads,
        HV=layout.num_v_heads,
        K=layout.head_k_dim,
        V=layout.head_v_dim,
        K_OFF=layout.k_offset,
        V_OFF=layout.v_offset,
        A_OFF=layout.a_offset,
        B_OFF=layout.b_offset,
    )


def commit(
    state: torch.Tensor,
    ring: torch.Tensor,
    layout: RingLayout,
    indices: torch.Tensor,
    num_accepted: torch.Tensor,
    gates: Gates,
    launch: tuple[int, int] | None = None,
    bv: int | None = None,
) -> None:
    n = indices.shape[0]
    if n == 0:
        return
    bk, bv, nv = _blocks(layout, n, bv)
    warps, stages = launch or COMMIT_LAUNCH
    _commit_kernel[(nv, n * layout.num_v_heads)](
        gates.A_log,
        gates.dt_bias,
        state,
        ring,
        indices,
        num_accepted,
        gates.threshold,
        state.stride(0),
        ring.stride(0),
        indices.stride(0),
        BK=bk,
        BV=bv,
        L2NORM=gates.use_qk_l2norm,
        num_warps=warps,
        num_stages=stages,
        **_offsets(layout),
    )


def verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    gates: Gates,
    state: torch.Tensor,
    ring: torch.Tensor,
    layout: RingLayout,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    launch: tuple[int, int] | None = None,
    bv: int | None = None,
) -> torch.Tensor:
    """``q, k [1, T, H, K]``, ``v [1, T, HV, V]``: any token and head strides
    (vLLM's views of the packed qkv need no copy); ``o`` is contiguous."""
    n = cu_seqlens.shape[0] - 1
    o = torch.empty(v.shape, dtype=q.dtype, device=v.device)
    if n == 0:
        return o
    bk, bv, nv = _blocks(layout, n, bv)
    warps, stages = launch or VERIFY_LAUNCH
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    _verify_kernel[(nv, n * layout.num_v_heads)](
        gates.A_log,
        a.contiguous(),
        b.contiguous(),
        gates.dt_bias,
        q,
        k,
        v,
        o,
        state,
        ring,
        cu_seqlens,
        slots,
        scale,
        gates.threshold,
        state.stride(0),
        ring.stride(0),
        slots.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(1),
        k.stride(2),
        v.stride(1),
        v.stride(2),
        BK=bk,
        BV=bv,
        L2NORM=gates.use_qk_l2norm,
        num_warps=warps,
        num_stages=stages,
        **_offsets(layout),
    )
    return o
