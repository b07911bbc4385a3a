# SPDX-License-Identifier: Apache-2.0
"""Gated-DeltaNet speculative verify with state replay: records, not states.

vLLM keeps ``1 + k`` full recurrent states per request while speculating: the
verify of ``1 + k`` tokens stores the state after each token in its own slot, and
the next step starts from the slot of the last accepted token. Here a request
keeps one state slot plus a small *record ring* beside it:

* the verify reads the state, runs the ``1 + k`` tokens (outputs exactly as
  vLLM's kernel computes them), stores each token's inputs to the state update
  (the raw key, value, ``a`` and ``b`` of the layer, exactly as the kernel
  received them, in the model dtype: no rounding) and marks the ring pending; it
  writes no state, except for a one-token verify (a step without drafts): its
  token is always kept, so the state after it is stored in place and nothing is
  left pending (the work of a plain decode: one state read, one write);
* the next step first *commits* the ring: the state advances over the accepted
  tokens only (``num_accepted`` of them) with the verify's own arithmetic
  (l2-normalised key, gate ``g = -exp(A_log) softplus(a + dt_bias)``,
  ``beta = sigmoid(b)``, the delta rule), so the committed state is the state
  vLLM would have kept in the slot of the last accepted token.

A record is ``H*K + HV*V + 2*HV`` model-dtype values, a state ``HV*V*K``: on the
Qwen3.6-27B shapes (16 key / 48 value heads of 128, bf16) the ring of 16 records
is 17% of one bf16 state, where vLLM keeps 15 extra states.

Ring layout (``RingLayout``, model dtype, one row per state slot): ``[0]`` the
pending flag, ``HEADER`` values of header, then the keys ``[R, H, K]``, the
values ``[R, HV, V]``, ``a`` ``[R, HV]`` and ``b`` ``[R, HV]`` of ``R = 1 + k``
records.

This module holds the layout and the vectorised torch implementation (the CPU
backend's path, and the reference the Triton kernels are tested against);
``gdn_replay_triton`` holds the CUDA kernels. ``commit``/``verify`` dispatch on
the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_dflash.cpu.gdn_ops import NULL_BLOCK_ID, _expand_heads, _gating, _l2norm

HEADER = 64  # values before the records (the flag at 0; 128-byte aligned in bf16)


@dataclass(frozen=True)
class RingLayout:
    records: int  # R = 1 + num_speculative_tokens
    num_k_heads: int  # per tensor-parallel rank
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int

    @property
    def k_offset(self) -> int:
        return HEADER

    @property
    def v_offset(self) -> int:
        return self.k_offset + self.records * self.num_k_heads * self.head_k_dim

    @property
    def a_offset(self) -> int:
        return self.v_offset + self.records * self.num_v_heads * self.head_v_dim

    @property
    def b_offset(self) -> int:
        return self.a_offset + self.records * self.num_v_heads

    @property
    def length(self) -> int:
        return self.b_offset + self.records * self.num_v_heads

    def views(self, rows: torch.Tensor):
        """(keys [n, R, H, K], values [n, R, HV, V], a [n, R, HV], b [n, R, HV])."""
        n, r, hv = rows.shape[0], self.records, self.num_v_heads
        k = rows[:, self.k_offset : self.v_offset].view(
            n, r, self.num_k_heads, self.head_k_dim
        )
        v = rows[:, self.v_offset : self.a_offset].view(n, r, hv, self.head_v_dim)
        a = rows[:, self.a_offset : self.b_offset].view(n, r, hv)
        b = rows[:, self.b_offset : self.length].view(n, r, hv)
        return k, v, a, b


def ring_layout(
    num_speculative_tokens: int,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    tp_size: int = 1,
) -> RingLayout:
    return RingLayout(
        records=num_speculative_tokens + 1,
        num_k_heads=num_k_heads // tp_size,
        num_v_heads=num_v_heads // tp_size,
        head_k_dim=head_k_dim,
        head_v_dim=head_v_dim,
    )


def gating(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, threshold: float
) -> torch.Tensor:
    """g = -exp(A_log) * softplus(a + dt_bias) (float32): the CPU GDN ops' gating,
    so that replay and per-slot verify agree bit for bit on the CPU backend."""
    return _gating(A_log, a, dt_bias, threshold)


def _live_slots(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows with a state slot, their slots with the null block for the others)."""
    idx = slots.long()
    live = idx > NULL_BLOCK_ID
    return live, torch.where(live, idx, 0)


@dataclass(frozen=True)
class Gates:
    """The layer's parameters and options of the gated delta rule."""

    A_log: torch.Tensor
    dt_bias: torch.Tensor
    threshold: float = 20.0
    use_qk_l2norm: bool = True


def _prepare(k_raw, a, b, gates: Gates, hv: int):
    """Normalised, head-expanded keys, gates and betas of a set of tokens (whole
    tensors at once, as the CPU GDN ops compute them)."""
    k32 = k_raw.float()
    if gates.use_qk_l2norm:
        k32 = _l2norm(k32)
    g = gating(gates.A_log, a, gates.dt_bias, gates.threshold)
    return _expand_heads(k32, hv), g, torch.sigmoid(b.float())


def _step(s, kt, v, g, beta):
    """One token of the delta rule on states ``s [n, HV, V, K]`` (float32)."""
    s_new = s * torch.exp(g)[..., None, None]
    u = (v.float() - (s_new @ kt[..., None])[..., 0]) * beta[..., None]
    return s_new + u[..., None] * kt[..., None, :]


# --- torch implementation ------------------------------------------------------


def commit_torch(
    state: torch.Tensor,
    ring: torch.Tensor,
    layout: RingLayout,
    indices: torch.Tensor,
    num_accepted: torch.Tensor,
    gates: Gates,
) -> None:
    """Advance each pending row's state over its first ``num_accepted`` records.

    ``state [slots, HV, V, K]``, ``ring [slots, L]``; ``indices [N]`` the rows'
    state slots (``<= 0``: none), ``num_accepted [N]``. The ring stays as it is
    (its flag is rewritten by the next verify or cleared by the caller).
    """
    n = indices.shape[0]
    if n == 0:
        return
    live, safe = _live_slots(indices)
    pending = live & (ring[safe, 0] > 0)
    count = torch.where(pending, num_accepted[:n].long().clamp(0, layout.records), 0)
    steps = int(count.max())
    if steps == 0:
        return
    rows = safe[count > 0]
    count = count[count > 0]
    keys, values, a, b = layout.views(ring[rows])
    kt, g, beta = _prepare(keys, a, b, gates, layout.num_v_heads)
    s = state[rows].float()  # [n, HV, V, K]
    for j in range(steps):
        s_new = _step(s, kt[:, j], values[:, j], g[:, j], beta[:, j])
        s = torch.where((count > j)[:, None, None, None], s_new, s)
    state[rows] = s.to(state.dtype)


def verify_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    gates: Gates,
    scale: float,
    state: torch.Tensor,
    ring: torch.Tensor,
    layout: RingLayout,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Outputs of each sequence's tokens from its state; records into its ring.

    ``q, k [T, H, K]``, ``v [T, HV, V]``, ``a, b [T, HV]`` as the layer computed
    them, ``slots [N]`` the sequences' state slots (``<= 0``: skipped, zero
    output). Returns ``o [T, HV, V]`` (float32). The state is not written, except
    for a sequence of one token: its state is stored and its ring not pending.
    """
    n = cu_seqlens.numel() - 1
    hv = layout.num_v_heads
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    if n == 0:
        return out
    lens = (cu_seqlens[1 : n + 1] - cu_seqlens[:n]).long()
    steps = int(lens.max())
    if steps == 0:
        return out
    if steps > layout.records:
        raise ValueError(f"verify of {steps} tokens > {layout.records} ring records")
    q32 = q.float()
    if gates.use_qk_l2norm:
        q32 = _l2norm(q32)
    q32 = _expand_heads(q32, hv) * scale
    kt, g, beta = _prepare(k, a, b, gates, hv)
    live, safe = _live_slots(slots[:n])
    s = torch.where(live[:, None, None, None], state[safe].float(), 0.0)
    t_idx = cu_seqlens[:n].long()[:, None] + torch.arange(steps, device=v.device)
    valid = (torch.arange(steps, device=v.device)[None, :] < lens[:, None]) & live[
        :, None
    ]
    t_idx = torch.where(valid, t_idx, 0)
    rows = ring[safe]
    keys, values, ring_a, ring_b = layout.views(rows)
    for t in range(steps):
        i = t_idx[:, t]
        on = valid[:, t]
        s_new = _step(s, kt[i], v[i], g[i], beta[i])
        o = (s_new @ q32[i][..., None])[..., 0]
        s = torch.where(on[:, None, None, None], s_new, s)
        out[i[on]] = o[on]
        keys[:, t] = torch.where(on[:, None, None], k[i].to(ring.dtype), keys[:, t])
        values[:, t] = torch.where(on[:, None, None], v[i].to(ring.dtype), values[:, t])
        ring_a[:, t] = torch.where(on[:, None], a[i].to(ring.dtype), ring_a[:, t])
        ring_b[:, t] = torch.where(on[:, None], b[i].to(ring.dtype), ring_b[:, t])
    # a one-token verify keeps its token: its state is stored, nothing is pending
    single = live & (lens == 1)
    state[safe[single]] = s[single].to(state.dtype)
    rows[:, 0] = (live & ~single).to(ring.dtype)  # (only live rows are written)
    ring[safe[live]] = rows[live]
    return out


# --- dispatch ------------------------------------------------------------------


def packed_qkv_views(
    mixed_qkv: torch.Tensor, key_heads: int, value_heads: int, head_k: int, head_v: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q, k [1, T, H, K]`` and ``v [1, T, HV, V]`` as views of a layer's packed
    ``[T, 2HK + HV*V]`` qkv (what vLLM's ``rearrange_mixed_qkv`` copies out);
    ``verify`` reads any token and head stride."""
    kd, vd = key_heads * head_k, value_heads * head_v
    q, k, v = torch.split(mixed_qkv, [kd, kd, vd], dim=-1)
    return (
        q.unflatten(-1, (key_heads, head_k)).unsqueeze(0),
        k.unflatten(-1, (key_heads, head_k)).unsqueeze(0),
        v.unflatten(-1, (value_heads, head_v)).unsqueeze(0),
    )


def commit(
    state: torch.Tensor,
    ring: torch.Tensor,
    layout: RingLayout,
    indices: torch.Tensor,
    num_accepted: torch.Tensor,
    gates: Gates,
) -> None:
    if state.is_cuda:
        from vllm_dflash.layers.ops import gdn_replay_triton

        gdn_replay_triton.commit(state, ring, layout, indices, num_accepted, gates)
    else:
        commit_torch(state, ring, layout, indices, num_accepted, gates)


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
    scale: float | None = None,
) -> torch.Tensor:
    """vLLM's speculative GDN verify (``fused_sigmoid_gating_delta_rule_update``
    with ``num_accepted_tokens``), replay form: ``q, k [1, T, H, K]``,
    ``v [1, T, HV, V]``, ``a, b [>=T, HV]``; returns ``o [1, T, HV, V]`` in q's
    dtype. ``slots [N]``: each sequence's state slot."""
    if scale is None:
        scale = k.shape[-1] ** -0.5
    if state.is_cuda:
        from vllm_dflash.layers.ops import gdn_replay_triton

        return gdn_replay_triton.verify(
            q, k, v, a, b, gates, state, ring, layout, cu_seqlens, slots, scale
        )
    t = q.shape[1]
    o = verify_torch(
        q[0], k[0], v[0], a[:t], b[:t], gates, scale, state, ring, layout,
        cu_seqlens, slots,
    )  # fmt: skip
    return o.to(q.dtype).unsqueeze(0)
