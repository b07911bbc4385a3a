# SPDX-License-Identifier: Apache-2.0
"""GDN state slots of speculative decodes: all-zero-draft batches
(dflash_gdn_zero_draft_decodes) and decodes that sat out a step
(dflash_gdn_slot_after_unscheduled_step). The engine runs that go wrong without
them are in tests/e2e/test_draft_length.py (hybrid, red with either disabled)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_dflash.spec_decode import gdn_unscheduled_slot as slot
from vllm_dflash.spec_decode import gdn_zero_drafts as zero


def test_zero_draft_batch_stays_speculative():
    t = torch.tensor([-1, 0, 0, -1])
    got = zero.keep_speculative(t)
    assert got.tolist() == [-1, 1, 0, -1] and t.tolist() == [-1, 0, 0, -1]
    assert (got >= 0).tolist() == (t >= 0).tolist()  # same speculative rows
    for unchanged in ([-1, 2, 0], [-1, -1], [3, 1]):
        x = torch.tensor(unchanged)
        assert zero.keep_speculative(x) is x
    assert zero.keep_speculative(None) is None
    assert zero.probe()


class _Buf:
    def __init__(self, n: int) -> None:
        self.np = np.ones(n, dtype=np.int32)
        # the device copy: newer than np for rows vLLM corrected on the GPU
        self.gpu = torch.full((n,), 7, dtype=torch.int32)


def _runner(req_ids, counts):
    batch = SimpleNamespace(
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        num_accepted_tokens_cpu=np.array(counts, dtype=np.int32),
    )
    batch.num_reqs = len(req_ids)
    return SimpleNamespace(
        input_batch=batch, num_accepted_tokens=_Buf(8), num_accepted_tokens_event=None
    )


def _out(scheduled, finished=(), resumed=()):
    return SimpleNamespace(
        num_scheduled_tokens={r: 1 for r in scheduled},
        finished_req_ids=set(finished),
        scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set(resumed)),
    )


def test_unscheduled_decode_keeps_its_accepted_count():
    runner = _runner(["a", "b", "c"], [3, 1, 5])
    slot.save_unscheduled(runner, _out(["b"]))  # a and c sit out
    assert getattr(runner, slot._SAVED) == {"a": 3, "c": 5}  # b: 1 needs nothing
    # a comes back (vLLM's add_request set its count to 1); c was preempted
    runner.input_batch.req_id_to_index = {"b": 0, "a": 1, "c": 2}
    runner.input_batch.num_accepted_tokens_cpu[:] = 1
    slot.restore_returning(runner, _out(["a", "b", "c"], resumed=["c"]))
    assert runner.num_accepted_tokens.np[:3].tolist() == [1, 3, 1]
    assert runner.input_batch.num_accepted_tokens_cpu.tolist() == [1, 3, 1]
    # only the returning row is written on the device (dflash_hybrid_no_accepted_sync
    # leaves the other rows' device counts newer than the host's)
    assert runner.num_accepted_tokens.gpu[:3].tolist() == [7, 3, 7]
    assert getattr(runner, slot._SAVED) == {}


def test_finished_requests_are_forgotten():
    runner = _runner(["a"], [4])
    slot.save_unscheduled(runner, _out([]))
    assert getattr(runner, slot._SAVED) == {"a": 4}
    runner.input_batch.req_id_to_index = {}
    slot.save_unscheduled(runner, _out([], finished=["a"]))
    assert getattr(runner, slot._SAVED) == {}
    assert slot.probe()


# --- the start-up warm-up of FULL CUDA graphs (dflash_gdn_zero_draft_decodes) ---

K = 3


class _Config(SimpleNamespace):
    """A VllmConfig stand-in (weak-referenceable, like VllmConfig)."""


def _gdn_builder(mode: str):
    """vLLM's GDN builder of an adaptive DFlash engine (CPU, eager)."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_dflash.config import draft_length

    config = _Config(
        compilation_config=SimpleNamespace(
            cudagraph_mode=SimpleNamespace(has_full_cudagraphs=lambda: False),
            max_cudagraph_capture_size=None,
        ),
        speculative_config=SimpleNamespace(
            method="dflash", num_speculative_tokens=K, parallel_drafting=True
        ),
        additional_config={
            draft_length.ADDITIONAL_CONFIG_KEY: {
                draft_length.KEY: draft_length.ADAPTIVE
            }
        },
        scheduler_config=SimpleNamespace(max_num_seqs=8),
        cache_config=SimpleNamespace(mamba_cache_mode=mode),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
    )
    spec = MambaSpec(
        block_size=16,
        shapes=((4, 3 + K), (2, 4, 4)),
        dtypes=(torch.float32, torch.float32),
        mamba_type="gdn_attention",
        mamba_cache_mode=mode,
        num_speculative_blocks=K,
    )
    return GDNAttentionMetadataBuilder(spec, ["l0"], config, torch.device("cpu"))


def _warmup_batch(rows: int):
    """What vLLM's eager warm-up before a FULL capture hands the builder at start-up:
    uniform decodes of 1 + k tokens, a zero block table, and the runner's
    zero-initialised draft and accepted counts."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.arange(rows + 1, dtype=torch.int32) * (K + 1)
    seq = torch.full((rows,), K + 1, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.clone(),
        query_start_loc_cpu=qsl,
        seq_lens=seq,
        num_reqs=rows,
        num_actual_tokens=int(qsl[-1]),
        max_query_len=K + 1,
        max_seq_len=K + 1,
        block_table_tensor=torch.zeros(rows, 4 + K, dtype=torch.int32),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        _seq_lens_cpu=seq,
        _num_computed_tokens_cpu=torch.zeros(rows, dtype=torch.int32),
    )
    zeros = torch.zeros(rows, dtype=torch.int32)
    return common, zeros.clone(), zeros.clone()


def _kernel_state_columns(md) -> list[int]:
    """The column of ``ssm_state_indices`` from which vLLM's speculative GDN kernel
    (fused_sigmoid_gating_delta_rule_update) loads each row's initial state:
    ``num_accepted_tokens - 1``."""
    n = md.num_spec_decodes
    return (md.num_accepted_tokens[:n].long() - 1).tolist()


@pytest.mark.parametrize("mode", ["align", "none"])
def test_startup_warmup_reads_state_columns_in_range(mode, isolated, monkeypatch):
    from vllm.model_executor.layers.fla.ops import index as fla_index

    from vllm_dflash.cpu.dflash_inputs import TRITON_SHIM

    # vLLM's own path for this batch is prefill: FLA's chunk indices use
    # triton.cdiv (no Triton on CPU; what cpu_gdn_triton_ops does in a CPU engine)
    monkeypatch.setattr(fla_index, "triton", TRITON_SHIM)
    isolated(zero.PATCH)
    builder = _gdn_builder(mode)
    common, drafts, accepted = _warmup_batch(4)
    # vLLM alone runs this batch as plain decodes: its speculative kernel is not called
    stock = builder.build(0, common, accepted, drafts)
    assert stock.num_spec_decodes == 0
    zero.apply()
    md = builder.build(0, common, accepted, drafts)
    assert md.num_spec_decodes == 4  # made speculative by the patch
    width = md.spec_state_indices_tensor.shape[1]
    assert width == K + 1
    cols = _kernel_state_columns(md)
    assert all(0 <= c < width for c in cols), cols  # red without at_least_one: -1
    assert accepted.tolist() == [0] * 4  # the runner's buffer is left as it was


def test_real_step_counts_pass_through(isolated):
    """A step whose decodes all verify 0 drafts after accepted drafts keeps its
    counts (what picks each request's state slot)."""
    isolated(zero.PATCH)
    zero.apply()
    builder = _gdn_builder("none")
    common, drafts, _ = _warmup_batch(3)
    accepted = torch.tensor([3, 1, 2], dtype=torch.int32)
    md = builder.build(0, common, accepted, drafts)
    assert md.num_spec_decodes == 3
    assert md.num_accepted_tokens[:3].tolist() == [3, 1, 2]
    assert zero.at_least_one(None) is None
