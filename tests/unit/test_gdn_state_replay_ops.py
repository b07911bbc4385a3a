# SPDX-License-Identifier: Apache-2.0
"""GDN state replay ops (torch, the CPU path): the outputs and states of vLLM's
per-token state slots (to float32 rounding; bit for bit on CUDA, tests/gpu).

vLLM's speculative verify (here the plugin's CPU version of vLLM's kernel,
``cpu/gdn_ops.py``, which the hybrid e2e tests hold to the float64 reference)
stores the state after each verified token in its own slot; the next step starts
from the slot of the last accepted token. The replay verify must give the same
outputs, and verify + commit of ``n`` accepted tokens must leave exactly the
state vLLM keeps in slot ``n - 1``, for every ``n``, over several steps, with
grouped value heads, padded rows and null slots. A one-token verify (a step
without drafts) stores the state after its token and leaves nothing pending.
"""

from __future__ import annotations

import pytest
import torch

from vllm_dflash.cpu import gdn_ops
from vllm_dflash.layers.ops import gdn_replay

H, HV, DK, DV = 2, 4, 8, 6  # key heads, value heads (grouped 2:1), head dims


def _inputs(gen, lens, k):
    t = sum(lens)
    return dict(
        q=torch.randn(1, t, H, DK, generator=gen),
        k=torch.randn(1, t, H, DK, generator=gen),
        v=torch.randn(1, t, HV, DV, generator=gen),
        a=torch.randn(t, HV, generator=gen),
        b=torch.randn(t, HV, generator=gen),
    )


def _cu(lens):
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return cu


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_verify_and_commit_equal_per_token_slots(state_dtype):
    gen = torch.Generator().manual_seed(0)
    k = 3
    r = k + 1
    layout = gdn_replay.ring_layout(k, H, HV, DK, DV)
    a_log = torch.randn(HV, generator=gen)
    dt_bias = torch.randn(HV, generator=gen)
    gates = gdn_replay.Gates(a_log, dt_bias)
    n_seq = 3
    # vLLM: 1 + k slots per sequence (slot 0 unused: the null block)
    slots_stock = torch.arange(1, 1 + n_seq * r, dtype=torch.int32).view(n_seq, r)
    state0 = torch.randn(1 + n_seq * r, HV, DV, DK, generator=gen).to(state_dtype)
    stock_state = state0.clone()
    # replay: one slot per sequence, its ring beside it (slot 0: null)
    replay_slots = torch.arange(1, 1 + n_seq, dtype=torch.int32)
    replay_state = torch.zeros(1 + n_seq, HV, DV, DK, dtype=state_dtype)
    replay_state[1:] = state0[slots_stock[:, 0]]
    ring = torch.zeros(1 + n_seq, layout.length)  # the model dtype: float32 here
    accepted = torch.ones(n_seq, dtype=torch.int32)  # first verify: from slot 0
    for step in range(5):
        # one row drafts fewer tokens; one verifies only its token on some steps
        lens = [r, r - 1 if step % 2 else r, 1 if step % 3 == 1 else r]
        x = _inputs(gen, lens, k)
        cu = _cu(lens)
        o_stock, _ = gdn_ops.fused_sigmoid_gating_delta_rule_update(
            A_log=a_log, dt_bias=dt_bias, initial_state=stock_state,
            inplace_final_state=True, cu_seqlens=cu, ssm_state_indices=slots_stock,
            num_accepted_tokens=accepted, use_qk_l2norm_in_kernel=True, **x,
        )  # fmt: skip
        gdn_replay.commit(replay_state, ring, layout, replay_slots, accepted, gates)
        o_replay = gdn_replay.verify(
            x["q"], x["k"], x["v"], x["a"], x["b"], gates, replay_state, ring,
            layout, cu, replay_slots,
        )  # fmt: skip
        if step == 0:  # from the same state: the same float32 operations
            assert torch.equal(o_replay, o_stock)
        # later: committed states differ from vLLM's slots by float32 rounding
        # (torch's vectorised exp/sigmoid/rsqrt round by position in the tensor)
        torch.testing.assert_close(o_replay, o_stock, rtol=1e-5, atol=1e-6)
        # pending records, except after a one-token verify: it stored its state
        assert ring[1:, 0].tolist() == [float(n > 1) for n in lens]
        accepted = torch.tensor(
            [1 + (step + i) % lens[i] for i in range(n_seq)], dtype=torch.int32
        )
        # the state vLLM keeps for the next step: slot num_accepted - 1
        want = stock_state[slots_stock[torch.arange(n_seq), accepted.long() - 1]]
        probe = replay_state.clone()
        gdn_replay.commit(probe, ring.clone(), layout, replay_slots, accepted, gates)
        torch.testing.assert_close(
            probe[1:].float(), want.float(), rtol=1e-5, atol=1e-6
        ) if state_dtype == torch.float32 else torch.testing.assert_close(
            probe[1:].float(), want.float(), rtol=1e-2, atol=1e-2
        )
        # vLLM: the slot of the last accepted token is the next start
        stock_state[slots_stock[:, 0]] = want


def test_commit_skips_null_slots_and_empty_rings():
    layout = gdn_replay.ring_layout(2, H, HV, DK, DV)
    gates = gdn_replay.Gates(torch.zeros(HV), torch.zeros(HV))
    state = torch.randn(3, HV, DV, DK)
    ring = torch.rand(3, layout.length) + 0.5  # garbage records
    ring[2, 0] = 0  # slot 2: nothing pending
    before = state.clone()

    def commit(slots, counts):
        gdn_replay.commit(
            state, ring, layout, torch.tensor(slots, dtype=torch.int32),
            torch.tensor(counts, dtype=torch.int32), gates,
        )  # fmt: skip

    commit([0, 2], [3, 3])
    assert torch.equal(state, before)
    commit([1], [0])
    assert torch.equal(state, before)  # nothing accepted: nothing to commit
    commit([1], [9])
    assert not torch.equal(state[1], before[1])  # clamped to the ring's records
    assert torch.equal(state[[0, 2]], before[[0, 2]])


def test_layout_sizes_of_the_27b_shapes():
    layout = gdn_replay.ring_layout(15, 16, 48, 128, 128)
    state_bytes = 48 * 128 * 128 * 2  # bf16 SSM state (vLLM's default there)
    ring_bytes = layout.length * 2  # bf16 ring: the model dtype
    assert layout.records == 16
    assert layout.length == 64 + 16 * (16 * 128 + 48 * 128 + 2 * 48)
    assert 0.16 < ring_bytes / state_bytes < 0.18
    tp2 = gdn_replay.ring_layout(15, 16, 48, 128, 128, tp_size=2)
    assert tp2.num_k_heads == 8 and tp2.num_v_heads == 24


def test_probe_sees_a_vllm_that_replays_itself(monkeypatch):
    """patches/v0.20.1/0017 adds use_gdn_state_replay: not needed there."""
    from vllm.model_executor.layers.mamba import mamba_utils

    from vllm_dflash.layers import gdn_state_replay

    assert gdn_state_replay.probe()
    monkeypatch.setattr(
        mamba_utils, "use_gdn_state_replay", lambda *a: True, raising=False
    )
    assert not gdn_state_replay.probe()


def test_qkv_views_equal_vllms_rearrange_without_copies():
    """``qkv_views`` (the replay's ``rearrange_mixed_qkv``) gives vLLM's q/k/v
    values as views of the packed tensor: no copy, same storage."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.mamba.gdn_linear_attn import (
        GatedDeltaNetAttention,
    )

    from vllm_dflash.layers import gdn_state_replay

    layer = SimpleNamespace(
        key_dim=H * DK, value_dim=HV * DV, tp_size=1, head_k_dim=DK, head_v_dim=DV
    )
    mixed = torch.randn(5, 2 * H * DK + HV * DV)
    want = GatedDeltaNetAttention.rearrange_mixed_qkv(layer, mixed)
    got = gdn_state_replay.qkv_views(layer, mixed)
    for w, g in zip(want, got, strict=True):
        assert g.shape == w.shape
        assert torch.equal(g, w)
        assert g.data_ptr() >= mixed.data_ptr()  # a view of the packed tensor
        assert g.untyped_storage().data_ptr() == mixed.untyped_storage().data_ptr()
    assert gdn_state_replay.qkv_views(layer, None) == (None, None, None)


def test_verify_reads_strided_qkv():
    """The CPU verify gives the same outputs and records for strided views as
    for contiguous copies."""
    gen = torch.Generator().manual_seed(3)
    lens = [4, 1, 3]
    t = sum(lens)
    layout = gdn_replay.ring_layout(3, H, HV, DK, DV)
    mixed = torch.randn(t, 2 * H * DK + HV * DV, generator=gen)
    q, k, v = gdn_replay.packed_qkv_views(mixed, H, HV, DK, DV)
    a, b = torch.randn(t, HV, generator=gen), torch.randn(t, HV, generator=gen)
    gates = gdn_replay.Gates(
        torch.randn(HV, generator=gen), torch.randn(HV, generator=gen)
    )
    slots = torch.tensor([1, 2, 3], dtype=torch.int32)
    state = torch.randn(4, HV, DV, DK, generator=gen) * 0.1
    outs = []
    for qq, kk, vv in ((q, k, v), (q.contiguous(), k.contiguous(), v.contiguous())):
        st, ring = state.clone(), torch.zeros(4, layout.length)
        o = gdn_replay.verify(
            qq, kk, vv, a, b, gates, st, ring, layout, _cu(lens), slots
        )
        outs.append((o, st, ring))
    assert not q.is_contiguous()
    for x, y in zip(outs[0], outs[1], strict=True):
        assert torch.equal(x, y)


def test_value_block_fills_the_grid_at_small_batches():
    """The value-block width: 32 where the grid is large, 16 where one request's
    grid would leave most SMs idle (measured fastest on an H100); never a width that leaves the grid
    below ``MIN_PROGRAMS`` while a narrower one is allowed."""
    from vllm_dflash.layers.ops import gdn_replay_triton as gt

    layout = gdn_replay.ring_layout(15, 16, 48, 128, 128)  # Qwen3.6-27B, TP 1
    widths = {n: gt.value_block(layout, n) for n in (1, 2, 3, 4, 16, 256)}
    assert widths == {1: 16, 2: 32, 3: 32, 4: 32, 16: 32, 256: 32}
    for n, bv in widths.items():
        programs = n * 48 * (128 // bv)
        assert programs >= gt.MIN_PROGRAMS or bv == gt.BV_CHOICES[-1]
    small = gdn_replay.ring_layout(3, 2, 4, 32, 6)  # a head dim below every width
    assert gt.value_block(small, 1) == 8 and gt.value_block(small, 10**6) == 8
