# SPDX-License-Identifier: Apache-2.0
"""dflash_align_accepted_counts_order: after ``_prepare_inputs`` every row keeps
the host accepted count it had on entry ('align' mode, asynchronous scheduling).
The engine runs that go wrong without it: tests/e2e/test_hybrid_prefix_caching.py
(vLLM's own asynchronous branch on the CPU backend) and the H200 run of
benchmarks/gpu/prefix_caching_check.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from vllm_dflash.spec_decode import hybrid_align_accepted_order as order


def _runner(mode: str = "align", async_: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        speculative_config=SimpleNamespace(method="dflash"),
        model_config=SimpleNamespace(is_hybrid=True),
        cache_config=SimpleNamespace(mamba_cache_mode=mode),
        use_async_scheduling=async_,
    )


def test_applies_only_to_align_async_dflash_hybrids():
    assert order.runner_applies(_runner())
    assert not order.runner_applies(_runner(mode="none"))
    assert not order.runner_applies(_runner(async_=False))
    other = _runner()
    other.speculative_config = SimpleNamespace(method="eagle")
    assert not order.runner_applies(other)


def test_probe_finds_the_remapping_on_this_vllm():
    assert order.probe()


def test_wrapper_restores_the_row_order_counts(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def stock(self, *args, **kwargs):  # vLLM's gather: new row i <- old row prev[i]
        prev = np.array([2, 0, -1])
        counts = self.input_batch.num_accepted_tokens_cpu
        counts[:3] = np.where(prev < 0, 1, counts[np.maximum(prev, 0)])
        return "out"

    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", stock)
    order.apply()
    runner = _runner()
    runner.input_batch = SimpleNamespace(
        num_reqs=3,
        prev_req_id_to_index={"a": 2, "b": 0},
        num_accepted_tokens_cpu=np.array([4, 2, 1, 1], dtype=np.int32),
    )
    assert GPUModelRunner._prepare_inputs(runner) == "out"
    assert runner.input_batch.num_accepted_tokens_cpu.tolist() == [4, 2, 1, 1]
    sync = _runner(async_=False)
    sync.input_batch = runner.input_batch
    GPUModelRunner._prepare_inputs(sync)  # not applied: vLLM's result stays
    assert runner.input_batch.num_accepted_tokens_cpu.tolist() == [1, 4, 1, 1]
