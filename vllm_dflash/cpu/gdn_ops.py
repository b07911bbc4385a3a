# SPDX-License-Identifier: Apache-2.0
"""Vectorised torch versions of the Triton ops vLLM's Gated-DeltaNet layer calls.

vLLM 0.20.x runs Qwen3-Next / Qwen3.5 / Qwen3.6 linear-attention (GDN) layers
through Triton kernels only (``GatedDeltaNetAttention._forward_core``): causal
conv1d (prefill and update), the post-conv split/L2-norm/gating, the chunked
gated delta rule (prefill), the recurrent update with per-token state slots
(multi-token speculative verify) and the packed single-token decode. vLLM-CPU
has no Triton driver, so none of them runs. These functions take the same
arguments and have the same effects (outputs, in-place state writes, skipped
null slots) as the kernels in ``vllm/model_executor/layers/{mamba,fla}/ops``.

Layouts (vLLM's, not Hugging Face's):

* SSM state ``[slots, HV, V, K]`` (HF keeps ``[K, V]``); float32 math inside.
* conv state ``[slots, dim, state_len]`` (a view; writes go through it);
  ``state_len = width - 1 + num_speculative_tokens``.
* Slot ``0`` is vLLM's null block: not read, not written.

Loops: the delta rule is a recurrence, so the recurrent path loops over time
steps (at most ``k + 1`` in a verify) and the chunked path over 64-token chunks;
everything else (sequences, heads, channels) is batched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NULL_BLOCK_ID = 0
CHUNK_SIZE = 64  # FLA_CHUNK_SIZE


# --- helpers ------------------------------------------------------------------


def _lens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return (cu_seqlens[1:] - cu_seqlens[:-1]).long()


def _pad_index(
    cu_seqlens: torch.Tensor, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token index ``[N, max_len]`` of each (sequence, step) and its validity."""
    lens = _lens(cu_seqlens)
    steps = torch.arange(max_len, device=cu_seqlens.device)
    valid = steps[None, :] < lens[:, None]
    idx = cu_seqlens[:-1].long()[:, None] + steps[None, :]
    return torch.where(valid, idx, 0), valid


def _act(x: torch.Tensor, activation: str | bool | None) -> torch.Tensor:
    if activation is True or activation in ("silu", "swish"):
        return F.silu(x)
    return x


def _softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    return torch.where(x <= threshold, torch.log1p(torch.exp(x)), x)


def _gating(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, threshold: float = 20.0
) -> torch.Tensor:
    """g = -exp(A_log) * softplus(a + dt_bias), float32."""
    x = a.float() + dt_bias.float()
    return -torch.exp(A_log.float()) * _softplus(x, threshold)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# --- causal conv1d -------------------------------------------------------------


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | bool | None = "silu",
    pad_slot_id: int = -1,
    null_block_id: int = NULL_BLOCK_ID,
    block_idx_first_scheduled_token: torch.Tensor | None = None,
    block_idx_last_scheduled_token: torch.Tensor | None = None,
    initial_state_idx: torch.Tensor | None = None,
    num_computed_tokens: torch.Tensor | None = None,
    block_size_to_align: int = 0,
    metadata: object = None,
    validate_data: bool = False,
) -> torch.Tensor:
    """Varlen causal conv1d (prefill) with conv-state read/write per sequence.

    ``x``: ``(dim, total_tokens)``. Sequence ``i`` starts from
    ``conv_states[cache_indices[i], :, :width-1]`` if ``has_initial_state[i]``
    (zeros otherwise) and leaves its last ``width-1`` inputs there.
    """
    if block_idx_last_scheduled_token is not None:
        raise NotImplementedError(
            "vllm-dflash CPU causal_conv1d_fn: mamba_cache_mode='all' "
            "(block_idx_*) is not supported; use mamba_cache_mode='align' or 'none'"
        )
    orig_dtype = x.dtype
    dim, total = x.shape
    width = weight.shape[1]
    hist = width - 1
    n = query_start_loc.numel() - 1
    lens = _lens(query_start_loc)
    max_len = int(lens.max()) if n > 0 else 0
    out = torch.empty(dim, total, dtype=conv_states.dtype, device=x.device)
    if n == 0 or max_len == 0:
        return out.to(orig_dtype)
    slots = (
        cache_indices.long()
        if cache_indices is not None
        else torch.arange(n, device=x.device)
    )
    live = (slots != null_block_id) & (slots >= 0)
    safe = torch.where(live, slots, 0)
    # [N, hist + max_len, dim]: history rows, then the sequence's tokens.
    buf = x.new_zeros(n, hist + max_len, dim, dtype=torch.float32)
    if has_initial_state is not None:
        prior = conv_states[safe, :, :hist].float().transpose(1, 2)  # [N, hist, dim]
        use = (has_initial_state.bool() & live)[:, None, None]
        buf[:, :hist] = torch.where(use, prior, 0.0)
    tok_idx, valid = _pad_index(query_start_loc, max_len)
    xt = x.t().float()  # [total, dim]
    buf[:, hist:] = torch.where(valid[..., None], xt[tok_idx], 0.0)
    # windows[n, t, :, j] = buf[n, t + j]
    windows = buf.unfold(1, width, 1)  # [N, max_len, dim, width]
    y = (windows * weight.float()[None, None]).sum(-1)
    if bias is not None:
        y = y + bias.float()
    y = _act(y, activation)
    out.t()[tok_idx[valid]] = y[valid].to(out.dtype)
    # New state: the last `hist` rows of [history, tokens] of each sequence.
    rows = lens[:, None] + torch.arange(hist, device=x.device)[None, :]
    new_state = buf.gather(1, rows[..., None].expand(-1, -1, dim))  # [N, hist, dim]
    conv_states[slots[live], :, :hist] = (
        new_state[live].transpose(1, 2).to(conv_states.dtype)
    )
    return out.to(orig_dtype)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: bool | str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = -1,
    null_block_id: int | None = NULL_BLOCK_ID,
    block_idx_last_scheduled_token: torch.Tensor | None = None,
    initial_state_idx: torch.Tensor | None = None,
    validate_data: bool = False,
) -> torch.Tensor:
    """Causal conv1d over a few new tokens per sequence, from and into its state.

    Decode: ``x`` is ``(batch, dim)`` or ``(batch, dim, seqlen)``. Speculative
    verify: ``x`` is ``(num_tokens, dim)`` with ``query_start_loc``; the state
    window starts at column ``num_accepted_tokens - 1`` (the state keeps the
    history plus every draft token of the previous step), and the state becomes
    ``[history[1:], x]`` (``width - 2 + seqlen`` columns). Like the kernel, the
    output overwrites ``x`` and is returned.
    """
    if block_idx_last_scheduled_token is not None:
        raise NotImplementedError(
            "vllm-dflash CPU causal_conv1d_update: mamba_cache_mode='all' "
            "is not supported; use mamba_cache_mode='align' or 'none'"
        )
    orig_dtype = x.dtype
    x = x.to(conv_state.dtype)
    width = weight.shape[1]
    hist = width - 1
    spec = num_accepted_tokens is not None
    if query_start_loc is None:
        squeeze = x.dim() == 2
        x3 = x.unsqueeze(-1) if squeeze else x  # [B, dim, S]
        batch, dim, seqlen = x3.shape
        lens = torch.full((batch,), seqlen, dtype=torch.long, device=x.device)
        xs = x3.transpose(1, 2)  # [B, S, dim]
        valid = torch.ones(batch, seqlen, dtype=torch.bool, device=x.device)
        tok_idx = None
    else:
        assert conv_state_indices is not None
        batch = conv_state_indices.size(0)
        dim = x.size(1)
        seqlen = max_query_len
        qsl = query_start_loc[: batch + 1]
        lens = _lens(qsl)
        tok_idx, valid = _pad_index(qsl, seqlen)
        xs = x[tok_idx]  # [B, S, dim]
    if batch == 0:
        return x.to(orig_dtype)
    slots = (
        conv_state_indices.long()
        if conv_state_indices is not None
        else torch.arange(batch, device=x.device)
    )
    live = (slots >= 0) if null_block_id is None else (slots != null_block_id)
    safe = torch.where(live, slots, 0)
    offset = (
        num_accepted_tokens[:batch].long() - 1
        if spec
        else torch.zeros(batch, dtype=torch.long, device=x.device)
    )
    state = conv_state[safe].float()  # [B, dim, L]
    alloc = state.shape[-1]
    xs32 = torch.where(valid[..., None], xs.float(), 0.0)
    # Convolution input: `hist` state columns from `offset`, then the tokens.
    cols = offset[:, None] + torch.arange(hist, device=x.device)[None, :]
    prior = state.gather(2, cols[:, None, :].expand(-1, dim, -1))  # [B, dim, hist]
    full = torch.cat([prior.transpose(1, 2), xs32], dim=1)  # [B, hist + S, dim]
    y = (full.unfold(1, width, 1) * weight.float()[None, None]).sum(-1)
    if bias is not None:
        y = y + bias.float()
    y = _act(y, activation)  # [B, S, dim]
    # New state (kernel STEP 2): state_len_i columns, the first from the old
    # state (shifted by 1 in spec mode, by seqlen otherwise), the rest from x.
    state_len0 = hist + (seqlen - 1) if spec else hist
    state_len = (
        state_len0 - (seqlen - lens)
        if query_start_loc is not None
        else (torch.full_like(lens, state_len0))
    )
    keep = state_len - lens  # columns taken from the old state
    t = torch.arange(max(state_len0, 1), device=x.device)[None, :]
    shift = 1 if spec else lens[:, None]
    src_state = (offset[:, None] + t + shift).clamp(0, alloc - 1)
    src_x = (t - keep[:, None]).clamp(0, max(seqlen - 1, 0))
    from_state = state.gather(2, src_state[:, None, :].expand(-1, dim, -1))
    from_x = xs32.gather(1, src_x[..., None].expand(-1, -1, dim)).transpose(1, 2)
    new = torch.where((t < keep[:, None])[:, None, :], from_state, from_x)
    write = (t < state_len[:, None]) & live[:, None]  # [B, T]
    b_idx, c_idx = write.nonzero(as_tuple=True)
    conv_state[slots[b_idx], :, c_idx] = new[b_idx, :, c_idx].to(conv_state.dtype)
    # Output overwrites x where the sequence is live (the kernel skips null slots).
    keep_out = valid & live[:, None]
    if query_start_loc is None:
        out3 = x3.transpose(1, 2)
        out3[keep_out] = y[keep_out].to(x.dtype)
        return x.to(orig_dtype)
    x[tok_idx[keep_out]] = y[keep_out].to(x.dtype)
    return x.to(orig_dtype)


# --- gated delta rule --------------------------------------------------------------


def fused_post_conv_prep(
    conv_output: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    apply_l2norm: bool = True,
    output_g_exp: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split conv output into q/k/v heads, L2-normalise q/k, compute g and beta."""
    length = conv_output.shape[0]
    hk = num_k_heads * head_k_dim
    hv = A_log.shape[0]
    dtype = conv_output.dtype
    q = conv_output[:, :hk].float().reshape(length, num_k_heads, head_k_dim)
    k = conv_output[:, hk : 2 * hk].float().reshape(length, num_k_heads, head_k_dim)
    v = conv_output[:, 2 * hk :].reshape(length, hv, head_v_dim).to(dtype).contiguous()
    if apply_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    g = _gating(A_log, a, dt_bias)
    if output_g_exp:
        g = torch.exp(g)
    beta = torch.sigmoid(b.float())
    return (
        q.to(dtype).contiguous(),
        k.to(dtype).contiguous(),
        v,
        g.contiguous(),
        beta.contiguous(),
    )


def _expand_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[..., H, D] -> [..., HV, D]: v head i uses q/k head i // (HV // H)."""
    h = x.shape[-2]
    return x if h == hv else x.repeat_interleave(hv // h, dim=-2)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule over variable-length sequences (prefill).

    ``q, k``: ``[1, T, H, K]``; ``v``: ``[1, T, HV, V]``; ``g`` (log decay),
    ``beta``: ``[1, T, HV]``; ``initial_state``: ``[N, HV, V, K]``. Returns
    ``o [1, T, HV, V]`` (q's dtype) and the final states ``[N, HV, V, K]`` (fp32).
    Sequences are padded to whole chunks (padding: k = v = beta = g = 0 leaves
    the state unchanged) and processed together, one chunk step at a time.
    """
    if cu_seqlens is None:
        bsz, t_len = q.shape[:2]
        cu_seqlens = torch.arange(0, (bsz + 1) * t_len, t_len, device=q.device)
        q, k, v, g, beta = (
            x.reshape(1, bsz * t_len, *x.shape[2:]) for x in (q, k, v, g, beta)
        )
    dtype = q.dtype
    hv, dv = v.shape[-2], v.shape[-1]
    dk = k.shape[-1]
    if scale is None:
        scale = dk**-0.5
    q32, k32 = q[0].float(), k[0].float()
    if use_qk_l2norm_in_kernel:
        q32, k32 = _l2norm(q32), _l2norm(k32)
    q32, k32 = _expand_heads(q32, hv), _expand_heads(k32, hv)
    n = cu_seqlens.numel() - 1
    lens = _lens(cu_seqlens)
    max_len = int(lens.max()) if n > 0 else 0
    c = CHUNK_SIZE
    padded = max(-(-max_len // c) * c, c)
    tok_idx, valid = _pad_index(cu_seqlens, padded)
    m = valid[..., None]

    def pad(x: torch.Tensor) -> torch.Tensor:  # [T, HV, ...] -> [N, HV, P, ...]
        y = torch.where(m.view(*m.shape, *([1] * (x.dim() - 2))), x[tok_idx], 0.0)
        return y.transpose(1, 2)

    qp = pad(q32) * scale
    kp = pad(k32)
    vp = pad(v[0].float())
    gp = pad(g[0].float())  # [N, HV, P]
    bp = pad(beta[0].float())
    nc = padded // c
    qc, kc, vc = (x.reshape(n, hv, nc, c, -1) for x in (qp, kp, vp))
    gc = gp.reshape(n, hv, nc, c).cumsum(-1)
    bc = bp.reshape(n, hv, nc, c)
    kb, vb = kc * bc[..., None], vc * bc[..., None]
    lower = torch.tril(torch.ones(c, c, dtype=torch.bool, device=q.device))
    strict = torch.tril(torch.ones(c, c, dtype=torch.bool, device=q.device), -1)
    diff = gc[..., :, None] - gc[..., None, :]
    decay = torch.where(lower, diff, -torch.inf).exp()
    # WY form: T = (I + strict_lower(beta k k^T * decay))^-1 (unit lower-triangular).
    a_mat = torch.where(strict, (kb @ kc.transpose(-1, -2)) * decay, 0.0)
    eye = torch.eye(c, dtype=torch.float32, device=q.device)
    t_mat = torch.linalg.solve_triangular(
        a_mat + eye, eye.expand_as(a_mat), upper=False, unitriangular=True
    )
    u = t_mat @ vb  # [N, HV, NC, C, V]
    w = t_mat @ (kb * gc.exp()[..., None])  # [N, HV, NC, C, K]
    state = (
        initial_state.float().transpose(-1, -2).clone()  # [N, HV, K, V]
        if initial_state is not None
        else q.new_zeros(n, hv, dk, dv, dtype=torch.float32)
    )
    out = torch.empty(n, hv, nc, c, dv, dtype=torch.float32, device=q.device)
    intra = torch.where(lower, (qc @ kc.transpose(-1, -2)) * decay, 0.0)
    for i in range(nc):
        v_new = u[:, :, i] - w[:, :, i] @ state
        g_i = gc[:, :, i]
        out[:, :, i] = (qc[:, :, i] * g_i.exp()[..., None]) @ state + intra[
            :, :, i
        ] @ v_new
        g_last = g_i[..., -1:]
        state = (
            state * g_last.exp()[..., None]
            + (kc[:, :, i] * (g_last - g_i).exp()[..., None]).transpose(-1, -2) @ v_new
        )
    o_pad = out.reshape(n, hv, padded, dv).transpose(1, 2)  # [N, P, HV, V]
    o = q.new_empty(1, q.shape[1], hv, dv, dtype=dtype)
    o[0, tok_idx[valid]] = o_pad[valid].to(dtype)
    final = state.transpose(-1, -2).contiguous() if output_final_state else None
    return o, final


def _recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    read_slot: torch.Tensor,
    write_slots: torch.Tensor | None,
    use_qk_l2norm: bool,
) -> torch.Tensor:
    """Delta-rule recurrence, one time step at a time over all sequences/heads.

    ``q, k [T, H, K]``, ``v [T, HV, V]``, ``g, beta [T, HV]`` (fp32, gating
    done). Sequence ``n`` starts from ``state_pool[read_slot[n]]`` and writes
    its state after step ``t`` to ``state_pool[write_slots[n, t]]`` (slot 0 =
    null: not read, not written). Returns ``o [T, HV, V]`` (fp32; zeros for
    null sequences).
    """
    hv = v.shape[1]
    q32, k32 = q.float(), k.float()
    if use_qk_l2norm:
        q32, k32 = _l2norm(q32), _l2norm(k32)
    q32, k32 = _expand_heads(q32, hv) * scale, _expand_heads(k32, hv)
    n = cu_seqlens.numel() - 1
    lens = _lens(cu_seqlens)
    steps = int(lens.max()) if n > 0 else 0
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    if steps == 0:
        return out
    tok_idx, valid = _pad_index(cu_seqlens, steps)
    live = read_slot > NULL_BLOCK_ID
    h = state_pool[torch.where(live, read_slot, 0)].float()  # [N, HV, V, K]
    h = torch.where(live[:, None, None, None], h, 0.0)
    for t in range(steps):
        idx = tok_idx[:, t]
        on = valid[:, t] & live
        k_t, q_t = k32[idx], q32[idx]  # [N, HV, K]
        h_new = h * torch.exp(g[idx].float())[..., None, None]
        v_t = (v[idx].float() - (h_new @ k_t[..., None])[..., 0]) * beta[idx].float()[
            ..., None
        ]
        h_new = h_new + v_t[..., None] * k_t[..., None, :]
        o_t = (h_new @ q_t[..., None])[..., 0]  # [N, HV, V]
        h = torch.where(on[:, None, None, None], h_new, h)
        out[idx[on]] = o_t[on]
        if write_slots is not None:
            slot = write_slots[:, t] if write_slots.dim() == 2 else write_slots
            store = on & (slot > NULL_BLOCK_ID)
            state_pool[slot[store].long()] = h[store].to(state_pool.dtype)
    return out


def fused_sigmoid_gating_delta_rule_update(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: float = 1.0,
    threshold: float = 20.0,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    inplace_final_state: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    is_kda: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent gated delta rule with gating fused in (decode and verify).

    With ``ssm_state_indices`` ``[N, k+1]`` and ``num_accepted_tokens``
    (speculative verify), sequence ``n`` starts from slot
    ``indices[n, num_accepted[n] - 1]`` and stores the state after its token
    ``t`` in ``indices[n, t]``; with 1-D indices (decode) it reads and writes
    ``indices[n]``. ``a``/``b`` rows are indexed like ``q``'s tokens.
    """
    if is_kda:
        raise NotImplementedError("vllm-dflash CPU GDN fallback: KDA is not supported")
    if initial_state is None or ssm_state_indices is None or cu_seqlens is None:
        raise NotImplementedError(
            "vllm-dflash CPU GDN fallback needs initial_state, ssm_state_indices "
            "and cu_seqlens (as vLLM's GDN layer passes them)"
        )
    if not inplace_final_state:
        raise NotImplementedError(
            "vllm-dflash CPU GDN fallback: inplace_final_state=False is not supported"
        )
    if beta != 1.0:
        raise NotImplementedError("vllm-dflash CPU GDN fallback: softplus beta != 1")
    dk = k.shape[-1]
    if scale is None:
        scale = dk**-0.5
    n = cu_seqlens.numel() - 1
    idx2 = ssm_state_indices.long()
    if idx2.dim() == 1:
        idx2 = idx2[:, None]
    idx2 = idx2[:n]
    if num_accepted_tokens is not None:
        first = num_accepted_tokens[:n].long() - 1
    else:
        first = torch.zeros(n, dtype=torch.long, device=q.device)
    read_slot = idx2.gather(1, first[:, None])[:, 0]
    t_tot = q.shape[1]
    g = _gating(A_log, a[:t_tot], dt_bias, threshold)
    bt = torch.sigmoid(b[:t_tot].float())
    o = _recurrent(
        q[0], k[0], v[0], g, bt, scale, initial_state, cu_seqlens, read_slot,
        idx2 if idx2.shape[1] > 1 else idx2[:, 0], use_qk_l2norm_in_kernel,
    )  # fmt: skip
    return o.to(q.dtype).unsqueeze(0), initial_state


def fused_recurrent_gated_delta_rule_packed_decode(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor,
    out: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step per sequence straight from the packed conv output."""
    bsz = mixed_qkv.shape[0]
    hv, dv, dk = initial_state.shape[-3:]
    hk = (mixed_qkv.shape[1] - hv * dv) // 2
    h = hk // dk
    q = mixed_qkv[:, :hk].reshape(bsz, h, dk)
    k = mixed_qkv[:, hk : 2 * hk].reshape(bsz, h, dk)
    v = mixed_qkv[:, 2 * hk :].reshape(bsz, hv, dv)
    g = _gating(A_log, a, dt_bias)
    # The kernel rounds beta to b's dtype before use.
    bt = torch.sigmoid(b.float()).to(b.dtype).float()
    cu = torch.arange(bsz + 1, device=mixed_qkv.device)
    slots = ssm_state_indices.long()
    o = _recurrent(
        q, k, v, g, bt, scale, initial_state, cu, slots, slots, use_qk_l2norm_in_kernel
    )
    out.copy_(o.to(out.dtype).reshape(out.shape))
    return out, initial_state
