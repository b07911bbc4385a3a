# SPDX-License-Identifier: Apache-2.0
"""The start-up refusal of DFlash + prefix caching on a hybrid target in 16-bit
on CUDA (vllm_dflash/config/hybrid_prefix_caching_cuda.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_dflash.config import hybrid_prefix_caching_cuda as refusal


def _config(dtype=torch.bfloat16, prefix=True, hybrid=True):
    return SimpleNamespace(
        model_config=SimpleNamespace(dtype=dtype, is_hybrid=hybrid),
        cache_config=SimpleNamespace(enable_prefix_caching=prefix),
    )


@pytest.fixture
def cuda(monkeypatch):
    monkeypatch.setattr(refusal, "_on_cuda", lambda: True)
    monkeypatch.delenv("VLLM_DFLASH_DISABLE", raising=False)


def test_refused_in_one_line_naming_what_works(cuda):
    with pytest.raises(refusal.HybridPrefixCachingCudaError) as e:
        refusal.check(_config())
    msg = str(e.value)
    assert "\n" not in msg and "bfloat16" in msg
    assert "--no-enable-prefix-caching" in msg and "--dtype float32" in msg


@pytest.mark.parametrize(
    "cfg",
    [
        _config(dtype=torch.float32),
        _config(prefix=False),
        _config(hybrid=False),
    ],
    ids=["float32", "no-prefix-caching", "dense-target"],
)
def test_what_works_is_not_refused(cuda, cfg):
    refusal.check(cfg)


def test_not_on_cpu(monkeypatch):
    monkeypatch.setattr(refusal, "_on_cuda", lambda: False)
    refusal.check(_config())


def test_off_switch(cuda, monkeypatch):
    monkeypatch.setenv("VLLM_DFLASH_DISABLE", refusal.NAME)
    refusal.check(_config())
