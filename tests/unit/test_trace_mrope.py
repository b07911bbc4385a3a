# SPDX-License-Identifier: Apache-2.0
"""VLLM_DFLASH_TRACE on M-RoPE targets: records count tokens, not M-RoPE row 0."""

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
