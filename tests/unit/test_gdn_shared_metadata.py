# SPDX-License-Identifier: Apache-2.0
"""dflash_gdn_shared_metadata: one GDN metadata build per step for all groups.

For every kind of batch the GDN builder sees (speculative decodes only, with and
without CUDA-graph padding; speculative decodes next to prefills or plain
decodes; prefills only; plain decodes only), the metadata of each group obtained
by building group 0 and calling ``update_block_table`` with the group's block
table equals what vLLM's own ``build`` gives that group, field by field, and the
slot indices a FULL CUDA graph reads sit in that group's own buffers.
"""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch

from vllm_dflash.attention import gdn_shared_metadata as shared
from vllm_dflash.registry import original

K = 3  # draft tokens
GROUPS = 3
MAX_SEQS = 8


class _Config(SimpleNamespace):
    """A VllmConfig stand-in (weak-referenceable, like VllmConfig)."""


def _config(full_graphs: bool):
    mode = SimpleNamespace(has_full_cudagraphs=lambda: full_graphs)
    return _Config(
        compilation_config=SimpleNamespace(
            cudagraph_mode=mode, max_cudagraph_capture_size=None
        ),
        speculative_config=SimpleNamespace(
            method="dflash", num_speculative_tokens=K, parallel_drafting=True
        ),
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_SEQS),
        cache_config=SimpleNamespace(mamba_cache_mode="none"),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
    )


def _spec():
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=16,
        shapes=((4, 3 + K), (2, 4, 4)),
        dtypes=(torch.float32, torch.float32),
        mamba_type="gdn_attention",
        num_speculative_blocks=K,
    )


def _builders(config):
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    return [
        GDNAttentionMetadataBuilder(_spec(), [f"l{g}"], config, torch.device("cpu"))
        for g in range(GROUPS)
    ]


def _tables(num_rows: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(num_rows)
    return [
        torch.randperm(200, generator=gen)[: num_rows * (K + 1)]
        .view(num_rows, K + 1)
        .int()
        + 1
        for _ in range(GROUPS)
    ]


def _common(query_lens, seq_lens, table, padded_tokens=None):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    tokens = int(qsl[-1]) if padded_tokens is None else padded_tokens
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(),
        query_start_loc_cpu=qsl,
        seq_lens=seq,
        num_reqs=len(query_lens),
        num_actual_tokens=tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=table,
        slot_mapping=torch.zeros(tokens, dtype=torch.int64),
        _seq_lens_cpu=seq,
        _num_computed_tokens_cpu=seq - torch.tensor(query_lens, dtype=torch.int32),
    )


# (name, query lengths, draft counts per row (-1: not speculative), padded tokens)
BATCHES = [
    ("spec only", [K + 1] * 3, [K] * 3, None),
    ("spec, padded rows", [K + 1] * 3 + [0], [K] * 3 + [-1], 4 * (K + 1)),
    ("spec + prefill", [K + 1, K + 1, 9], [K, K, -1], None),
    ("spec + plain decode", [K + 1, 1], [K, -1], None),
    ("spec, fewer drafts", [3, K + 1, 2], [2, K, 1], None),
    ("prefill only", [7, 5], [-1, -1], None),
    ("plain decodes", [1, 1, 1], [-1, -1, -1], None),
]


def _values(md) -> dict:
    out = {}
    for f in fields(md):
        v = getattr(md, f.name)
        out[f.name] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[x], b[x]) for x in a)
    return a == b


@pytest.fixture(scope="module", autouse=True)
def _patched():
    from vllm.model_executor.layers.fla.ops import index as fla_index

    from vllm_dflash.cpu.dflash_inputs import TRITON_SHIM

    assert shared.probe()
    shared.apply()
    # prefill batches: FLA's chunk indices use triton.cdiv (no Triton on CPU;
    # what cpu_gdn_triton_ops does in a CPU engine)
    saved = fla_index.triton
    fla_index.triton = TRITON_SHIM
    yield
    fla_index.triton = saved


@pytest.mark.parametrize("full_graphs", [False, True], ids=["eager", "cudagraphs"])
@pytest.mark.parametrize("batch", BATCHES, ids=[b[0] for b in BATCHES])
def test_update_equals_build(batch, full_graphs):
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    _, query_lens, drafts, padded = batch
    seq_lens = [40 + 3 * i for i in range(len(query_lens))]
    drafts_cpu = torch.tensor(drafts, dtype=torch.int32)
    accepted = torch.tensor([1 + i % (K + 1) for i in range(len(query_lens))])
    tables = _tables(len(query_lens))
    stock_build = original(GDNAttentionMetadataBuilder.build)

    # vLLM: every group built on its own (one engine per builder: no sharing)
    want = []
    for g in range(GROUPS):
        (ref,) = _builders(_config(full_graphs))[:1]
        md = stock_build(
            ref, 0, _common(query_lens, seq_lens, tables[g], padded), accepted,
            drafts_cpu,
        )  # fmt: skip
        want.append(_values(md))

    builders = _builders(_config(full_graphs))
    assert all(b.supports_update_block_table for b in builders)
    first = builders[0].build(
        0, _common(query_lens, seq_lens, tables[0], padded), accepted, drafts_cpu
    )
    got = [_values(first)]
    for g in range(1, GROUPS):
        md = builders[g].update_block_table(first, tables[g], None)
        got.append(_values(md))
        for name, buf in (
            ("spec_state_indices_tensor", builders[g].spec_state_indices_tensor),
            (
                "non_spec_state_indices_tensor",
                builders[g].non_spec_state_indices_tensor,
            ),
        ):
            t = getattr(md, name)
            in_first = getattr(first, name)
            if in_first is not None and shared._same_storage(
                in_first, getattr(builders[0], name)
            ):  # a CUDA-graph buffer: group g's graph reads group g's buffer
                assert shared._same_storage(t, buf), name
    for g in range(GROUPS):
        for name in want[g]:
            assert _equal(got[g][name], want[g][name]), (g, name)


def test_runner_reuses_one_build_per_spec():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_dflash.registry import code_reads

    assert code_reads(GPUModelRunner._build_attention_metadata, "update_block_table")


def test_group_independent_buffers_are_shared_per_engine():
    config = _config(True)
    a, b, c = _builders(config)
    (other,) = _builders(_config(True))[:1]
    for name in shared.SHARED_BUFFERS:
        assert getattr(a, name) is getattr(b, name) is getattr(c, name)
        assert getattr(other, name) is not getattr(a, name)
    assert a.spec_state_indices_tensor is not b.spec_state_indices_tensor


def test_other_engines_build_every_group():
    config = _config(True)
    config.speculative_config.method = "eagle3"
    assert not any(b.supports_update_block_table for b in _builders(config))
    config = _config(True)
    config.cache_config.mamba_cache_mode = "align"
    assert not any(b.supports_update_block_table for b in _builders(config))


def test_one_column_table_keeps_the_verify_width():
    rows = torch.arange(6).view(3, 2)
    assert shared.spec_columns(rows, 2) is not None
    assert torch.equal(shared.spec_columns(rows, 2), rows)
    one = rows[:, :1]
    wide = shared.spec_columns(one, 4)
    assert wide.shape == (3, 4) and torch.equal(wide[:, 3], one[:, 0])
