# SPDX-License-Identifier: Apache-2.0
"""CPU defect 2 where it exists (oneDNN repacking), simulated on any CPU."""

import torch

from vllm_dflash.cpu import weights
from vllm_dflash.registry import original


def _layer() -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False)
    return layer


def test_kept_for_dflash_qkv_only(monkeypatch, isolated):
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import utils

    monkeypatch.setattr(ops, "_supports_onednn", True)
    monkeypatch.setattr(
        ops, "create_onednn_mm", lambda w, block: object(), raising=False
    )
    assert weights.repacking_active()

    stock = original(utils.dispatch_cpu_unquantized_gemm)
    plain = _layer()
    stock(plain, remove_weight=True)
    assert plain.weight.numel() == 0  # the defect: F.linear(x, layer.weight) breaks

    isolated(weights.PATCH)
    weights.apply()
    qkv, other = _layer(), _layer()
    setattr(
        qkv, weights._KEEP, True
    )  # what the DFlashQwen3Attention.__init__ wrapper sets
    utils.dispatch_cpu_unquantized_gemm(qkv, remove_weight=True)
    utils.dispatch_cpu_unquantized_gemm(other, remove_weight=True)
    assert qkv.weight.shape == (8, 4) and other.weight.numel() == 0
