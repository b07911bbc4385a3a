# SPDX-License-Identifier: Apache-2.0
"""VLLM_DFLASH_TRACE records: token positions (M-RoPE targets) and the token history."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from vllm_dflash.spec_decode.trace import TokenHistory, collect_records


def _runner(req_ids, table):
    return SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=req_ids, token_ids_cpu=table),
        discard_request_mask=SimpleNamespace(np=np.zeros(len(req_ids), dtype=bool)),
    )


def test_mrope_records_use_the_token_index():
    # request "a": 3 new tokens after 10 computed ones, behind an image whose
    # M-RoPE row 0 lags the token index by 6; request "b": text, 2 new after 3.
    table = np.arange(100).reshape(2, 50)
    tokens = torch.tensor([110, 111, 112, 203, 204])
    mrope = torch.tensor([[4, 5, 6, 3, 4]] * 3)
    qsl = torch.tensor([0, 3, 5])
    seq_lens = torch.tensor([13, 5])
    drafts = torch.tensor([[1, 2], [3, 4]])
    recs = collect_records(
        _runner(["a", "b"], table), TokenHistory(), tokens, mrope,
        torch.tensor([113, 205]), qsl, None, drafts, seq_lens,
    )  # fmt: skip
    assert [r["num_tokens"] for r in recs] == [14, 6]
    assert recs[0]["last_token_ids"] == [110, 111, 112, 113]
    # token 2 of "b" is not in this step: read from the token table, by token index
    assert recs[1]["last_token_ids"] == [52, 203, 204, 205]
    # 1-D positions (text targets) are the token index already: unchanged
    recs_1d = collect_records(
        _runner(["a", "b"], table), TokenHistory(), tokens,
        torch.tensor([10, 11, 12, 3, 4]), torch.tensor([113, 205]), qsl, None,
        drafts,
    )  # fmt: skip
    assert recs_1d == recs


def test_newest_tokens_fill_the_history_under_async_scheduling():
    # Asynchronous scheduling: the host table holds -1 for tokens still on the
    # device, so the record must come from the history. Each step's newest
    # (sampled) token is the next step's first context token: the history has it
    # even where that step's inputs are not seen (the 2026-12-02 H200 traces missed
    # the context-only passes: tests/unit/test_patch_chains.py) or hold a
    # placeholder there.
    table = np.full((1, 50), -1)
    table[0, :4] = [7, 8, 9, 10]
    runner = _runner(["a"], table)
    history = TokenHistory()
    step1 = collect_records(
        runner, history, torch.tensor([9, 10]), torch.tensor([2, 3]),
        torch.tensor([21]), torch.tensor([0, 2]), None, torch.tensor([[5, 6]]),
    )  # fmt: skip
    assert step1[0]["last_token_ids"] == [8, 9, 10, 21]
    # next step: context [21 (read as -1), 22 accepted, 99 rejected], newest 23
    step2 = collect_records(
        runner, history, torch.tensor([-1, 22, 99]), torch.tensor([4, 5, 6]),
        torch.tensor([23]), torch.tensor([0, 3]), torch.tensor([1]),
        torch.tensor([[5, 6]]),
    )  # fmt: skip
    assert step2[0]["num_tokens"] == 7
    assert step2[0]["last_token_ids"] == [10, 21, 22, 23]
