# SPDX-License-Identifier: Apache-2.0
"""dflash_gdn_state_replay in the 'align' mamba cache mode: vLLM's
``preprocess_mamba`` / ``postprocess_mamba`` (run for real on pages laid out as
vLLM lays them out) move a replay page whole, and a block boundary inside the
accepted tokens gets the state the records up to it give. The engine runs:
tests/e2e/test_hybrid_prefix_caching.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_dflash.cpu.gdn import _batch_memcpy
from vllm_dflash.layers import gdn_replay_align as align
from vllm_dflash.layers import gdn_state_replay as replay
from vllm_dflash.layers.ops import gdn_replay

BLOCK, K, BLOCKS = 8, 4, 6  # tokens a block, drafts a step, pages
HK, HV, DK, DV, DIM = 1, 2, 4, 4, 6
LAYOUT = gdn_replay.ring_layout(K, HK, HV, DK, DV)
SHAPES = ((3 + K, DIM), (HV, DV, DK), (LAYOUT.length,))  # conv, state, ring


def _spec():
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        shapes=SHAPES, dtypes=(torch.float32,) * 3, block_size=BLOCK,
        mamba_cache_mode="align",
    )  # fmt: skip


def _layer(seed: int) -> SimpleNamespace:
    """A GDN layer's three state tensors over one page a block (as
    GPUModelRunner._reshape_kv_cache_tensors lays out a MambaSpec)."""
    spec = _spec()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(BLOCKS * spec.page_size_bytes // 4, generator=g)
    tensors, offset = [], 0
    for shape in SHAPES:
        n = int(np.prod(shape))
        tensors.append(
            torch.as_strided(
                raw,
                (BLOCKS, *shape),
                (spec.page_size_bytes // 4, *torch.empty(shape).stride()),
                offset,
            )  # fmt: skip
        )
        offset += n
    ring = tensors[2]
    ring[:, 0] = 1.0  # every ring pending
    return SimpleNamespace(
        kv_cache=tensors,
        A_log=torch.randn(HV, generator=g) * 0.1,
        dt_bias=torch.randn(HV, generator=g) * 0.1,
    )


def _engine(block_ids: list[int], computed: int, accepted: int):
    from vllm.v1.worker import mamba_utils

    layer = _layer(0)
    config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(layer_names=["gdn"], kv_cache_spec=_spec())]
    )

    def make_buffer(n, dtype):
        from vllm.v1.utils import CpuGpuBuffer as Buffer

        return Buffer(n, dtype=dtype, device="cpu", pin_memory=False)

    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateCopyFuncCalculator,
    )

    funcs = MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()
    bufs = mamba_utils.MambaCopyBuffers.create(4, config, funcs, make_buffer)
    batch = SimpleNamespace(
        req_ids=["r"], num_reqs=1, num_accepted_tokens_cpu=np.array([accepted])
    )
    requests = {
        "r": SimpleNamespace(num_computed_tokens=computed, block_ids=[block_ids])
    }
    return layer, config, funcs, bufs, batch, requests


def _committed(layer, slot: int, count: int) -> torch.Tensor:
    """The state of ``slot`` after its first ``count`` records (the reference)."""
    state, ring = layer.kv_cache[1].clone(), layer.kv_cache[2].clone()
    gates = gdn_replay.Gates(layer.A_log, layer.dt_bias, 20.0, True)
    idx, num = torch.tensor([slot]), torch.tensor([count])
    gdn_replay.commit_torch(state, ring, LAYOUT, idx, num, gates)
    return state[slot]


@pytest.mark.parametrize(
    "computed, accepted, src, dest, bias",
    [
        # verify of positions 6..10 (running state after 7 tokens, in block 1);
        # 3 accepted pass the boundary at 8: block 0 gets the state after 8
        (6, 3, 1, 0, 1),
        # verify of positions 3..7, all 5 accepted: the boundary at 8 is the last
        # accepted token, in the running block itself
        (3, 5, 0, 0, 4),
    ],
)
def test_boundary_state_is_the_records_up_to_it(computed, accepted, src, dest, bias):
    from vllm.v1.worker import mamba_utils

    block_ids = [3, 5]
    layer, config, funcs, bufs, batch, requests = _engine(block_ids, computed, accepted)
    s_blk, d_blk = block_ids[src], block_ids[dest]
    conv, state, ring = layer.kv_cache
    want_state = _committed(layer, s_blk, bias + 1)
    want_conv = conv[s_blk, bias:].clone()
    src_state, src_ring = state[s_blk].clone(), ring[s_blk].clone()
    out = SimpleNamespace(
        scheduled_spec_decode_tokens={"r": [7] * K}, num_scheduled_tokens={"r": 1 + K}
    )
    align.postprocess(
        out, config, batch, requests, {"r": src}, {"gdn": layer}, funcs, bufs,
        collect=mamba_utils.collect_mamba_copy_meta, memcpy=_batch_memcpy,
        layout_of=lambda _: LAYOUT,
    )  # fmt: skip
    torch.testing.assert_close(state[d_blk], want_state, rtol=0, atol=0)
    torch.testing.assert_close(conv[d_blk, : 3 + K - bias], want_conv, rtol=0, atol=0)
    assert ring[d_blk, 0] == 0  # a cached block has nothing pending
    if src != dest:  # the running page keeps its state and pending records
        assert torch.equal(state[s_blk], src_state) and torch.equal(
            ring[s_blk], src_ring
        )
        assert batch.num_accepted_tokens_cpu[0] == accepted
    else:  # the running state is the boundary's: vLLM's count of 1
        assert batch.num_accepted_tokens_cpu[0] == 1


def test_no_boundary_no_work():
    from vllm.v1.worker import mamba_utils

    layer, config, funcs, bufs, batch, requests = _engine([3, 5], 6, 1)
    before = [t.clone() for t in layer.kv_cache]
    out = SimpleNamespace(
        scheduled_spec_decode_tokens={"r": [7] * K}, num_scheduled_tokens={"r": 1 + K}
    )
    align.postprocess(
        out, config, batch, requests, {"r": 1}, {"gdn": layer}, funcs, bufs,
        collect=mamba_utils.collect_mamba_copy_meta, memcpy=_batch_memcpy,
        layout_of=lambda _: LAYOUT,
    )  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(before, layer.kv_cache, strict=True))


def test_preprocess_moves_the_whole_page_and_keeps_the_count(monkeypatch):
    from vllm.v1.worker import mamba_utils

    monkeypatch.setattr(mamba_utils, "batch_memcpy", _batch_memcpy)
    # state in block 0 (index 0) after a verify that accepted 3; this step's last
    # token is in block 1
    layer, config, funcs, bufs, batch, requests = _engine([3, 5], 7, 3)
    page = [t[3].clone() for t in layer.kv_cache]
    out = SimpleNamespace(
        finished_req_ids=set(), preempted_req_ids=set(),
        scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
        num_scheduled_tokens={"r": 1 + K},
    )  # fmt: skip
    cache = SimpleNamespace(enable_prefix_caching=True)
    state_idx = {"r": 0}
    align.preprocess(
        mamba_utils.preprocess_mamba, out, config, cache, state_idx, batch, requests,
        {"gdn": layer}, funcs, bufs,
    )  # fmt: skip
    assert state_idx["r"] == 1
    assert all(torch.equal(t[5], p) for t, p in zip(layer.kv_cache, page, strict=True))
    assert batch.num_accepted_tokens_cpu[0] == 3  # the commit still owes 3 records


def test_align_mode_replays():
    """One GDN state per request with prefix caching too (vLLM: 1 + k)."""
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(method="dflash"),
        model_config=SimpleNamespace(architecture="Qwen3_5ForConditionalGeneration"),
        cache_config=SimpleNamespace(mamba_cache_mode="align"),
    )
    assert replay.config_replays(cfg)
    layer = SimpleNamespace(
        speculative_config=cfg.speculative_config, cache_config=cfg.cache_config
    )
    assert replay._layer_replays(layer)
