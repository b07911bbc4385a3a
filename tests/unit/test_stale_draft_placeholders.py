# SPDX-License-Identifier: Apache-2.0
"""dflash_async_stale_draft_placeholders on vLLM's real AsyncScheduler.

Requests generate to ``max_model_len`` with random acceptance, the engine's
two-deep batch queue simulated (step N's output arrives after step N + 1 is
scheduled). Without the patch a request that sat out a step at the context's
end comes back with ``-1`` draft placeholders that no worker can fill (on CUDA:
the engine died at the target's embedding, H100, 2026-12-07); with
``VLLM_DFLASH_DISABLE=dflash_async_stale_draft_placeholders`` the main test fails.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from vllm_dflash import envs
from vllm_dflash.core import stale_draft_placeholders as stale

pytest.importorskip("vllm.v1.core.sched.async_scheduler")

TARGET = Path(__file__).resolve().parents[2] / "fixtures" / "trained" / "target"
MAX_LEN, K, BLOCK = 64, 4, 16


@pytest.fixture
def make_scheduler(isolated, monkeypatch):
    import torch
    from vllm.config import (
        CacheConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    isolated(stale.PATCH)
    if stale.NAME not in envs.disabled_patches():
        stale.apply()
        stale.apply()  # idempotent
    # the stand-in speculative method (ngram: no drafter to load) counts as DFlash
    monkeypatch.setattr(stale, "uses_dflash", lambda config: True)
    model = ModelConfig(
        model=str(TARGET),
        dtype="float32",
        max_model_len=MAX_LEN,
        skip_tokenizer_init=True,
    )
    spec = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=K,
        prompt_lookup_max=2,
        prompt_lookup_min=2,
        target_model_config=model,
        target_parallel_config=ParallelConfig(),
    )
    sched_config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=256, max_model_len=MAX_LEN,
        is_encoder_decoder=False,
    )  # fmt: skip
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=False)
    config = VllmConfig(
        model_config=model,
        scheduler_config=sched_config,
        cache_config=cache,
        speculative_config=spec,
    )
    # vLLM accepts async scheduling with GPU speculative methods only; the
    # scheduler itself does not care which method drafts.
    sched_config.async_scheduling = True
    cache.num_gpu_blocks = 64
    kv = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32
                ),
            )
        ],
    )

    def make() -> AsyncScheduler:
        return AsyncScheduler(
            vllm_config=config,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
        )

    return make


def _generate(sched, rng: random.Random) -> tuple[list, int, int]:
    """One request to the context's end. Returns (the steps that scheduled -1
    drafts for a request not in the previous step, steps a running request sat
    out, the request's final length)."""
    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    prompt = rng.randrange(5, 40)
    req = Request(
        "r", list(range(1, prompt + 1)), SamplingParams(max_tokens=1000, ignore_eos=True), None
    )  # fmt: skip
    sched.add_request(req)
    tokens = itertools.count(100)
    queue, prev, stale_steps, sat_out = [], set(), [], 0
    for step in range(200):
        out = sched.schedule()
        now = set(out.num_scheduled_tokens)
        sat_out += sum(r.request_id not in now for r in sched.running)
        for rid, spec in out.scheduled_spec_decode_tokens.items():
            if -1 in spec and rid not in prev:
                stale_steps.append((step, list(spec)))
        prev = now
        queue.append(out)
        if len(queue) == 2 or not now:
            done = queue.pop(0)
            ids = list(done.num_scheduled_tokens)
            sampled = []
            for rid in ids:
                r = sched.requests.get(rid)
                if r is not None and r.is_prefill_chunk:
                    sampled.append([])
                    continue
                n = len(done.scheduled_spec_decode_tokens.get(rid, ()))
                accepted = rng.randrange(0, n + 1)
                sampled.append([next(tokens) for _ in range(accepted + 1)])
            sched.update_from_output(
                done,
                ModelRunnerOutput(
                    req_ids=ids,
                    req_id_to_index={r: i for i, r in enumerate(ids)},
                    sampled_token_ids=sampled,
                ),
            )
        if not sched.requests:
            break
    return stale_steps, sat_out, req.num_tokens


def test_probe_sees_the_stock_scheduler_keep_placeholders():
    assert stale.probe()


def test_no_request_returns_with_draft_placeholders(make_scheduler):
    stale_runs, sat_out_runs = [], 0
    for seed in range(40):
        steps, sat_out, length = _generate(make_scheduler(), random.Random(seed))
        assert length == MAX_LEN  # generated to the context's end
        sat_out_runs += sat_out > 0
        if steps:
            stale_runs.append((seed, steps[:2]))
    assert sat_out_runs >= 10  # the case occurs: requests sat out a step
    assert not stale_runs, (len(stale_runs), stale_runs)
