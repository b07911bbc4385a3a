# SPDX-License-Identifier: Apache-2.0
"""GPU-only helpers tested without a GPU: the step profile's bookkeeping and the
capture-session de-duplication of drafter graphs (TP>1 start-up fix)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from vllm_dflash.cpu.attention import split_kv_cache
from vllm_dflash.spec_decode import tp_graph_replay as capture
from vllm_dflash.spec_decode.step_profile import StepProfile, _counted


def test_step_profile_means_and_reset(tmp_path):
    path = tmp_path / "p.json"
    prof = StepProfile(str(path))
    # A prefill-only step (no draft), then two drafting steps.
    prof.add("target_forward", 0.010)
    prof.add("sample_total", 0.002)
    prof.end_step(1)
    for _ in range(2):
        prof.add("target_forward", 0.004)
        prof.add("sample_total", 0.005)  # includes the 3 ms draft
        prof.add("draft_total", 0.003)
        prof.add("context_kv", 0.001)
        prof.add("draft_sample", 0.0005)
        prof.end_step(2)
    rep = json.loads(path.read_text())
    assert rep["steps"] == 3 and rep["draft_steps"] == 2
    ms = rep["mean_ms"]
    assert abs(ms["target_forward"] - 6.0) < 1e-6  # (10 + 4 + 4) / 3
    assert abs(ms["draft_forward"] - 1.5) < 1e-6  # 3 - 1 - 0.5, drafting steps only
    assert abs(ms["sample_verify"] - (2 + 2 + 2) / 3) < 1e-6
    path.unlink()  # a reader took the window: next step starts fresh
    prof.add("target_forward", 0.001)
    prof.end_step(1)
    assert json.loads(path.read_text())["steps"] == 1


def test_dispatch_counts_per_mode_and_size(tmp_path):
    path = tmp_path / "p.json"
    prof = StepProfile(str(path))
    mode = SimpleNamespace(name="FULL")

    def dispatch(num_tokens, **kw):
        return mode, SimpleNamespace(num_tokens=1 << (num_tokens - 1).bit_length())

    counted = _counted(dispatch, prof, "target")
    assert counted(48)[1].num_tokens == 64  # decisions pass through unchanged
    counted(50)
    counted(num_tokens=3)
    prof.end_step(1)
    rep = json.loads(path.read_text())
    assert rep["cudagraph_dispatch"] == {"target": {"FULL:64": 2, "FULL:4": 1}}
    path.unlink()
    prof.end_step(1)
    assert json.loads(path.read_text())["cudagraph_dispatch"] == {}


def test_split_kv_cache_both_layouts():
    blocks, heads, bs, hd = 3, 2, 16, 32
    five = torch.randn(2, blocks, heads, bs, hd)
    k, v, b, h = split_kv_cache(five)
    assert (b, h) == (bs, hd) and k.data_ptr() == five[0].data_ptr()
    four = torch.randn(blocks, heads, bs, 2 * hd)  # vLLM 0.23 layout
    k, v, b, h = split_kv_cache(four)
    assert (b, h) == (bs, hd) and k.shape == (blocks, heads, bs, hd)
    # Same slicing as vLLM 0.23's forward: view [.., 2*bs, hd] then chunk dim 2.
    ref_k, ref_v = four.view(blocks, heads, 2 * bs, hd).chunk(2, dim=2)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
    k.fill_(1.0)
    assert torch.equal(four.view(blocks, heads, 2 * bs, hd)[:, :, :bs], k)  # a view


def test_graph_key_follows_the_clamp():
    calls = []

    def pad(n, use_cudagraphs=True):
        calls.append(n)
        return ("FULL", 1 << (n - 1).bit_length(), None)

    prop = SimpleNamespace(
        max_query_tokens=256, _determine_batch_execution_and_padding=pad
    )
    # Every target size above the clamp asks for the same drafter graph.
    assert (
        capture.graph_key(prop, 512) == capture.graph_key(prop, 1024) == ("FULL", 256)
    )
    assert capture.graph_key(prop, 100) == ("FULL", 128)


def test_capture_probe_sees_the_clamp_in_this_vllm():
    assert capture.probe() is True
