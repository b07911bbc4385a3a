# SPDX-License-Identifier: Apache-2.0
"""dflash_hybrid_no_accepted_sync: the accepted counts without the host wait.

The patch relies on one property of vLLM's asynchronous speculative decoding:
after ``update_num_computed_tokens_for_batch_change`` the device counts no longer
depend on the host-synchronised values, given that every row without drafts last
step had count 1. Checked here with vLLM's own function on random batch changes
(rows reordered, new, gone, drafted or not), against what the stock host path
(wait, gather in the new order, then the same GPU correction) computes.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from vllm_dflash.spec_decode import hybrid_accepted_sync as sync


def _stock_and_patched(rng: random.Random) -> tuple[list[int], list[int]]:
    from vllm.v1.spec_decode.utils import update_num_computed_tokens_for_batch_change

    k = rng.randint(1, 15)
    prev_n = rng.randint(1, 12)
    drafts = [rng.choice([0, rng.randint(0, k), k]) for _ in range(prev_n)]
    # a row samples its accepted drafts plus one token: 1 without drafts
    accepted = [rng.randint(1, d + 1) for d in drafts]
    kept = rng.sample(range(prev_n), rng.randint(0, prev_n))
    new_rows = rng.randint(0, 4)
    prev_pos = kept + [-1] * new_rows
    rng.shuffle(prev_pos)
    n = len(prev_pos)
    if n == 0:
        return [], []
    prev_positions = torch.tensor(prev_pos, dtype=torch.int64)
    valid = torch.tensor(accepted, dtype=torch.int64)
    # vLLM records the previous drafts of the requests still in the batch only
    prev_drafts = torch.zeros(16, dtype=torch.int32)
    for p in kept:
        prev_drafts[p] = drafts[p]

    def run(start: torch.Tensor) -> list[int]:
        counts = start.clone()
        update_num_computed_tokens_for_batch_change(
            torch.zeros(16, dtype=torch.int32),
            counts,
            prev_positions,
            valid,
            prev_drafts,
            torch.zeros(n, dtype=torch.int32),
        )
        return counts.tolist()

    host = torch.tensor(  # stock: the synchronised host counts, new order
        [accepted[p] if p >= 0 else 1 for p in prev_pos], dtype=torch.int32
    )
    return run(host), run(torch.ones(n, dtype=torch.int32))


def test_gpu_correction_makes_the_host_counts_redundant():
    rng = random.Random(0)
    checked = 0
    for _ in range(400):
        stock, patched = _stock_and_patched(rng)
        assert patched == stock
        checked += len(stock)
    assert checked > 1000


def _runner(**over):
    class Event:
        pass

    runner = SimpleNamespace(
        speculative_config=SimpleNamespace(method="dflash"),
        model_config=SimpleNamespace(is_hybrid=True),
        cache_config=SimpleNamespace(mamba_cache_mode="none"),
        use_async_spec_decode=True,
        num_accepted_tokens_event=Event(),
        valid_sampled_token_count_gpu=torch.ones(2),
        input_batch=SimpleNamespace(prev_req_id_to_index={"a": 0}),
    )
    for key, value in over.items():
        setattr(runner, key, value)
    return runner


def test_which_runners_skip_the_wait():
    assert sync.runner_applies(_runner())
    assert not sync.runner_applies(_runner(speculative_config=None))
    assert not sync.runner_applies(
        _runner(speculative_config=SimpleNamespace(method="eagle3"))
    )
    assert not sync.runner_applies(_runner(model_config=SimpleNamespace(is_hybrid=0)))
    assert not sync.runner_applies(
        _runner(cache_config=SimpleNamespace(mamba_cache_mode="align"))
    )
    assert not sync.runner_applies(_runner(use_async_spec_decode=False))
    assert sync.gpu_counts_complete(_runner())
    # no GPU correction this step: vLLM's host path (with its wait) stays
    assert not sync.gpu_counts_complete(_runner(valid_sampled_token_count_gpu=None))
    assert not sync.gpu_counts_complete(
        _runner(input_batch=SimpleNamespace(prev_req_id_to_index={}))
    )


def test_wrapper_hides_the_event_for_one_call_only():
    assert sync.probe()
    seen = []

    def fake_prepare_inputs(self, *a, **k):  # stands in for vLLM's function
        seen.append(self.num_accepted_tokens_event)
        return "out"

    wrapped = _wrap_with(fake_prepare_inputs)
    runner = _runner()
    event = runner.num_accepted_tokens_event
    assert wrapped(runner) == "out" and seen[-1] is None
    assert runner.num_accepted_tokens_event is event  # restored
    for other in (
        _runner(valid_sampled_token_count_gpu=None),  # no GPU correction this step
        _runner(model_config=SimpleNamespace(is_hybrid=False)),
    ):
        assert wrapped(other) == "out"
        assert seen[-1] is other.num_accepted_tokens_event


def _wrap_with(fake):
    """The patch's wrapper around ``fake`` (apply() on a stand-in runner class)."""
    from vllm.v1.worker import gpu_model_runner

    class Stand:
        _prepare_inputs = fake

    real = gpu_model_runner.GPUModelRunner
    gpu_model_runner.GPUModelRunner = Stand
    try:
        sync.apply()
    finally:
        gpu_model_runner.GPUModelRunner = real
    return Stand._prepare_inputs


def test_probe_compiles_nothing():
    """The probe runs in every CUDA process that imports the model runner, DFlash or
    not: it must not compile vLLM's torch.compile'd helper (it once did: a CPU
    Inductor compile per GPU worker start, 17 s for a direct call on the 2-core VM,
    and in grad mode, so the first real step compiled it again)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    assert sync.probe()
    assert not counters["frames"]["total"], dict(counters["frames"])
