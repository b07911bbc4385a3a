# SPDX-License-Identifier: Apache-2.0
"""dflash_min_tokens_positions: ``min_tokens`` in speculative steps.

A row that predicts output token ``o`` must have the request's stop tokens masked
iff ``o < min_tokens``, as without speculation. vLLM 0.20.1's processor masks the
bonus row by the request's length before the step, and under asynchronous
scheduling counts the optimistic placeholders of rejected drafts. These tests
drive vLLM's own processor through the class methods (patched unless
``VLLM_DFLASH_DISABLE=dflash_min_tokens_positions``); with the patch disabled the
batch tests fail.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from vllm_dflash import envs, registry
from vllm_dflash.sample import min_tokens

builtin = pytest.importorskip("vllm.v1.sample.logits_processor.builtin")
Proc = builtin.MinTokensLogitsProcessor
VOCAB = 8


@pytest.fixture
def patched(isolated, monkeypatch):
    isolated(min_tokens.PATCH)
    monkeypatch.setattr(registry, "_dflash_in_use", True)
    if min_tokens.NAME not in envs.disabled_patches():
        min_tokens.apply()
        min_tokens.apply()  # idempotent


def test_probe_sees_the_stock_bonus_row_masked():
    assert min_tokens.probe()


def _batch(rng: random.Random, n_reqs: int, inflate: bool):
    """Requests (prompt, true outputs L, drafts n, min, stops, host list length)."""
    reqs = []
    for _ in range(n_reqs):
        n = rng.randrange(0, 5)
        out = rng.randrange(0, 12)
        # async: the host list also holds the previous step's rejected drafts
        extra = rng.randrange(0, 4) if inflate else 0
        reqs.append(
            SimpleNamespace(
                prompt=rng.randrange(3, 9),
                out=out,
                n=n,
                min=rng.choice([0, rng.randrange(1, 16)]),
                stops=set(rng.sample(range(VOCAB), rng.randrange(1, 3))),
                host=[-1] * (out + extra),
            )
        )
    return reqs


def _expected(reqs) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks of the draft rows and the bonus rows, from output positions."""
    draft = torch.zeros(sum(r.n for r in reqs), VOCAB, dtype=torch.bool)
    bonus = torch.zeros(len(reqs), VOCAB, dtype=torch.bool)
    row = 0
    for i, r in enumerate(reqs):
        for j in range(r.n):
            if r.out + j < r.min:
                draft[row, list(r.stops)] = True
            row += 1
        if r.out + r.n < r.min:
            bonus[i, list(r.stops)] = True
    return draft, bonus


def _run(reqs) -> tuple[torch.Tensor, torch.Tensor]:
    proc = Proc(None, torch.device("cpu"), False)
    added = [
        (i, SimpleNamespace(min_tokens=r.min, all_stop_token_ids=r.stops), [0] * r.prompt, r.host)
        for i, r in enumerate(reqs)
    ]  # fmt: skip
    proc.update_state(SimpleNamespace(added=added, removed=[], moved=[]))
    # the runner's step: seq_len = prompt + outputs + drafts (1 + n scheduled)
    runner = SimpleNamespace(
        seq_lens=torch.tensor(
            [r.prompt + r.out + r.n for r in reqs], dtype=torch.int32
        ),
        input_batch=SimpleNamespace(
            num_prompt_tokens=[r.prompt for r in reqs],
            logitsprocs=SimpleNamespace(non_argmax_invariant=[proc]),
        ),
    )
    min_tokens.attach(runner)
    proc.update_state(None)  # a step without batch changes
    draft = proc.apply_with_spec_decode(
        torch.zeros(sum(r.n for r in reqs), VOCAB), [r.n for r in reqs]
    )
    bonus = proc.apply(torch.zeros(len(reqs), VOCAB))
    return torch.isinf(draft), torch.isinf(bonus)


@pytest.mark.parametrize("inflate", [False, True], ids=["sync", "async"])
def test_masks_follow_output_positions(patched, inflate):
    rng = random.Random(3 + inflate)
    for _ in range(40):
        reqs = _batch(rng, rng.randrange(1, 6), inflate)
        want_draft, want_bonus = _expected(reqs)
        draft, bonus = _run(reqs)
        assert torch.equal(draft, want_draft), [vars(r) for r in reqs]
        assert torch.equal(bonus, want_bonus), [vars(r) for r in reqs]


def test_bonus_row_after_accepted_drafts_may_stop(patched):
    """One output so far, min_tokens 3, 4 drafts: drafts 0-1 masked, the bonus row
    (output token 5) not. vLLM 0.20.1 masks the bonus row."""
    r = SimpleNamespace(prompt=4, out=1, n=4, min=3, stops={1}, host=[-1])
    draft, bonus = _run([r])
    assert draft[:, 1].tolist() == [True, True, False, False]
    assert bonus[:, 1].tolist() == [False]


def test_request_stays_tracked_until_it_leaves(patched):
    proc = Proc(None, torch.device("cpu"), False)
    params = SimpleNamespace(min_tokens=2, all_stop_token_ids={1})
    proc.update_state(
        SimpleNamespace(added=[(0, params, [0], [-1] * 9)], removed=[], moved=[])
    )
    assert proc.__dict__.get(min_tokens._ENTRIES) == {0: (2, (1,))}
    proc.update_state(SimpleNamespace(added=[], removed=[0], moved=[]))
    assert not proc.__dict__.get(min_tokens._ENTRIES)


def test_other_processes_keep_vllm_behaviour(patched, monkeypatch):
    monkeypatch.setattr(registry, "_dflash_in_use", False)
    proc = Proc(None, torch.device("cpu"), False)
    params = SimpleNamespace(min_tokens=3, all_stop_token_ids={1})
    proc.update_state(
        SimpleNamespace(added=[(0, params, [0], [7])], removed=[], moved=[])
    )
    bonus = proc.apply(torch.zeros(1, VOCAB))
    assert torch.isinf(bonus[0, 1])  # vLLM's own rule: masked by membership
