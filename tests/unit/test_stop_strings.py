# SPDX-License-Identifier: Apache-2.0
"""dflash_stop_string_token_trim: a stop string completed inside a multi-token
step ends the request's tokens (and logprob rows) at its token, as the same
tokens arriving one a step (no speculation) do."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import skip_unless_needed
from vllm_dflash import registry
from vllm_dflash.engine import stop_strings

pytest.importorskip("vllm.v1.engine.detokenizer")


@pytest.fixture
def patched(monkeypatch, isolated):
    skip_unless_needed(stop_strings.NAME)
    isolated(stop_strings.PATCH)
    stop_strings.apply()
    stop_strings.apply()  # idempotent
    monkeypatch.setattr(registry, "_dflash_in_use", True)


def _one_step(tokens: list[int]):
    detokenizer = stop_strings._probe_detokenizer()  # 0 "a", 1 "b" (stop), 2 "c"
    step = list(tokens)
    stop = detokenizer.update(step, False)
    return stop, step, list(detokenizer.output_token_ids), detokenizer.output_text


def _per_token(tokens: list[int]):
    detokenizer = stop_strings._probe_detokenizer()
    for i, t in enumerate(tokens):
        stop = detokenizer.update([t], False)
        if stop is not None:
            return (
                stop,
                tokens[: i + 1],
                list(detokenizer.output_token_ids),
                (detokenizer.output_text),
            )
    return None, tokens, list(detokenizer.output_token_ids), detokenizer.output_text


def test_stock_keeps_tokens_after_the_stop_string():
    skip_unless_needed(stop_strings.NAME)
    assert stop_strings.probe()


@pytest.mark.parametrize("tokens", [[0, 1, 2], [1, 2, 2], [0, 0, 2], [2, 0, 1]])
def test_a_step_ends_where_single_tokens_would(patched, tokens):
    assert _one_step(tokens) == _per_token(tokens)


def test_engines_without_dflash_keep_the_stock_update(patched, monkeypatch):
    monkeypatch.setattr(registry, "_dflash_in_use", False)
    stop, step, ids, _ = _one_step([0, 1, 2])
    assert stop == "b" and step == [0, 1, 2] and ids == [0, 1, 2]


def test_logprob_rows_follow_the_cut_tokens(monkeypatch, isolated):
    from types import SimpleNamespace

    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists

    skip_unless_needed(stop_strings.NAME)
    isolated(stop_strings.PATCH)
    seen = []
    monkeypatch.setattr(
        LogprobsProcessor, "update_from_output", lambda self, out: seen.append(out)
    )
    stop_strings.apply()
    rows = LogprobsLists(np.zeros((3, 2)), np.arange(6.0).reshape(3, 2), np.zeros(3))
    out = SimpleNamespace(new_token_ids=[5, 6], new_logprobs=rows)
    LogprobsProcessor.update_from_output(None, out)
    assert seen[0].new_logprobs.logprobs.tolist() == [[0.0, 1.0], [2.0, 3.0]]
    assert len(seen[0].new_logprobs.sampled_token_ranks) == 2
    full = SimpleNamespace(new_token_ids=[5, 6, 7], new_logprobs=rows)
    LogprobsProcessor.update_from_output(None, full)
    assert seen[1].new_logprobs is rows
