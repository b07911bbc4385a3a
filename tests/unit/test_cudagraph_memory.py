# SPDX-License-Identifier: Apache-2.0
"""dflash_cudagraph_memory_measured: vLLM's own estimator, run on a simulated device.

vLLM's real ``GPUModelRunner.profile_cudagraph_memory`` runs here with the device
calls it makes (``mem_get_info``, synchronise, the capture context, the graph pool)
replaced by a simulated GPU whose graphs share one pool, and whose second graph
warm-up pays a one-off allocation (as the DFlash engine's did on the H200:
6.60 GiB estimated for 0.88 GiB of graphs). With the patch the estimate is the
footprint of all graphs (+ vLLM's 1 MiB floor per other graph); without it, vLLM
multiplies the one-off by the number of graphs. Engines without DFlash keep
vLLM's estimate and its calls exactly.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import restore_after
from vllm_dflash import envs
from vllm_dflash.spec_decode import cudagraph_memory as cm

MIB = 1 << 20
ONE_OFF = 700 * MIB  # paid once, by the second graph's warm-up
POOL_PER_TOKEN = MIB // 4  # a graph of n tokens needs n/4 MiB of the shared pool


class FakeGPU:
    """Free memory of a device whose captured graphs share one pool."""

    def __init__(self) -> None:
        self.total = 140 << 30
        self.used = 10 << 30
        self.pool = 0  # bytes held by the profiling pool (largest graph so far)
        self.graphs = 0
        self.warmups = 0
        self.calls: list[tuple[int, str]] = []
        self.seq_lens: list[int | None] = []  # profile_seq_lens of each capture

    def mem_get_info(self, *args) -> tuple[int, int]:
        return self.total - self.used, self.total

    def dummy_run(self, num_tokens: int, cudagraph_runtime_mode=None, **kw) -> None:
        mode = getattr(cudagraph_runtime_mode, "name", str(cudagraph_runtime_mode))
        self.calls.append((num_tokens, mode))
        if kw.get("is_graph_capturing"):
            self.seq_lens.append(kw.get("profile_seq_lens"))
        else:
            self.warmups += 1
            if self.warmups == 2:  # the second warm-up: a one-off (cached) growth
                self.used += ONE_OFF
            return
        need = num_tokens * POOL_PER_TOKEN
        if need > self.pool:  # the shared pool grows to the largest graph
            self.used += need - self.pool
            self.pool = need
        self.used += MIB // 2  # per-graph driver overhead
        self.graphs += 1

    def footprint(self, start_used: int) -> int:
        return self.used - start_used


def _descs():
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    piecewise = [BatchDescriptor(num_tokens=n) for n in (512, 256, 128, 64, 32, 16, 8)]
    full = [
        BatchDescriptor(num_tokens=n, uniform=True) for n in (256, 192, 128, 64, 16)
    ]
    return [(CUDAGraphMode.PIECEWISE, piecewise), (CUDAGraphMode.FULL, full)]


def _runner(gpu: FakeGPU, method: str | None):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = GPUModelRunner.__new__(GPUModelRunner)
    descs = _descs()
    runner.vllm_config = SimpleNamespace()
    runner.speculative_config = SimpleNamespace(method=method) if method else None
    runner.compilation_config = SimpleNamespace(cudagraph_num_of_warmups=1)
    runner.max_model_len = 8192
    runner.max_num_tokens = 8192
    runner.lora_config = None
    runner.device = torch.device("cpu")
    runner.cudagraph_dispatcher = SimpleNamespace(
        get_capture_descs=lambda: descs,
        cudagraph_keys={mode: set() for mode, _ in descs},
        keys_initialized=True,
    )
    runner._init_minimal_kv_cache_for_profiling = lambda: None
    runner._cleanup_profiling_kv_cache = lambda: None
    runner.maybe_remove_all_loras = lambda lora_config: None
    runner._dummy_run = gpu.dummy_run
    return runner


@pytest.fixture
def fake_device(monkeypatch):
    from vllm.v1.worker import gpu_model_runner as gmr

    gpu = FakeGPU()
    monkeypatch.setattr(torch.cuda, "mem_get_info", gpu.mem_get_info)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda *a: None)
    monkeypatch.setattr(gmr, "graph_capture", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(
        gmr, "current_platform", SimpleNamespace(graph_pool_handle=lambda: "pool")
    )
    return gpu


@pytest.fixture(scope="module", autouse=True)
def _patched():
    """Applied for this module only: later tests chain their own patches in
    catalog order and must not find it applied."""
    assert cm.probe()
    with pytest.MonkeyPatch.context() as mp:
        restore_after(mp, cm.PATCH)
        if cm.NAME not in envs.disabled_patches():  # VLLM_DFLASH_DISABLE: the red run
            cm.apply()
        yield


def _profile(runner) -> int:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner.profile_cudagraph_memory(runner)


def test_dflash_estimate_is_the_measured_footprint(fake_device):
    gpu = fake_device
    start = gpu.used
    estimate = _profile(_runner(gpu, "dflash"))
    n = sum(len(d) for _, d in _descs())
    true = gpu.footprint(start)  # every graph captured once, one-off included
    assert gpu.graphs == n
    # vLLM's bookkeeping adds its 1 MiB floor for every graph after each mode's first
    assert true <= estimate <= true + n * MIB, (estimate / MIB, true / MIB)
    # the stock extrapolation would charge the one-off once per graph: > 4 GiB here
    assert estimate < 2 * ONE_OFF


def test_captures_follow_vllms_order_and_profile_lengths(fake_device):
    gpu = fake_device
    runner = _runner(gpu, "dflash")
    _profile(runner)
    captured = gpu.calls[1::2]  # one warm-up, then its capture
    assert captured == [(d.num_tokens, m.name) for m, ds in _descs() for d in ds]
    # vLLM warms the first FULL graph up at the longest context the budget allows
    assert gpu.seq_lens == [None] * 7 + [8192 // 256] + [None] * 4
    assert getattr(runner, cm._SESSION) is None  # the session ended


def test_other_engines_keep_vllms_estimate(fake_device):
    gpu = fake_device
    estimate = _profile(_runner(gpu, None))  # no speculation
    # vLLM's own: two graphs per mode, the second one's one-off extrapolated
    assert gpu.graphs == 4
    assert estimate > 4 * ONE_OFF


def test_capture_model_path_is_untouched(fake_device):
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    gpu = fake_device
    runner = _runner(gpu, "dflash")
    runner._warmup_and_capture(BatchDescriptor(num_tokens=64), CUDAGraphMode.PIECEWISE)
    assert gpu.calls == [(64, "NONE"), (64, "PIECEWISE")]


def test_probe_reads_the_extrapolation():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert cm.probe()

    def measured_everything(self):  # what an upstream fix might look like
        return sum(self._warmup_and_capture(d) for d in ())

    saved = GPUModelRunner.profile_cudagraph_memory
    try:
        GPUModelRunner.profile_cudagraph_memory = measured_everything
        assert not cm.probe()
    finally:
        GPUModelRunner.profile_cudagraph_memory = saved


def test_applied_after_the_tp_capture_session_patch():
    """dflash_tp_graph_replay's profile wrapper calls vLLM's function itself: this
    patch must wrap that wrapper (catalog order), or DFlash engines at any TP size
    would get vLLM's extrapolation again."""
    from vllm_dflash.catalog import PATCHES
    from vllm_dflash.spec_decode import tp_graph_replay

    names = [p.name for p in PATCHES]
    assert names.index(tp_graph_replay.NAME) < names.index(cm.NAME)
