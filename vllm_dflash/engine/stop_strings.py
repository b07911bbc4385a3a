# SPDX-License-Identifier: Apache-2.0
"""A stop string inside an accepted draft block ends the output at its token.

vLLM 0.20.x's ``BaseIncrementalDetokenizer.update`` receives all the tokens a
step produced, detokenizes them, then checks stop strings once and truncates
only the text. With speculative decoding a step holds up to ``k + 1`` tokens:
when a stop string completes at the i-th of them, the tokens after it stay in
the request's ``token_ids`` (and their logprobs in its logprobs), and
``usage.completion_tokens`` counts them (measured through ``vllm serve`` on the
tiny trained pair: 11 with DFlash vs 10 without speculation). Without
speculation the step that completes the stop string holds that one token.

The patch feeds a multi-token step to the stock ``update`` one token at a time,
the way the steps of an engine without speculation arrive, and stops at the
first stop string: the step's token list (the engine-core output's own list,
which the request output is built from) is cut after that token, and the
logprobs processor keeps as many rows as tokens remain. Token ids, logprobs,
text, usage, ``finish_reason`` and ``stop_reason`` then equal those without
speculation.

Only in processes that run DFlash (``registry.dflash_in_use()``); requests
without stop strings and single-token steps take the stock path.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from vllm_dflash.registry import (
    ALL_PLATFORMS,
    V020,
    Patch,
    PatchKind,
    dflash_in_use,
    original,
    replace_attr,
)

NAME = "dflash_stop_string_token_trim"
_DETOKENIZER = "vllm.v1.engine.detokenizer:BaseIncrementalDetokenizer.update"
_LOGPROBS = "vllm.v1.engine.logprobs:LogprobsProcessor.update_from_output"


def update_per_token(
    stock: Any, detokenizer: Any, new_token_ids: list[int], stop_terminated: bool
) -> str | None:
    """``stock(detokenizer, ...)`` one token at a time; at the first stop string
    the tokens after it are removed from ``new_token_ids`` (in place)."""
    last = len(new_token_ids) - 1
    for i, token_id in enumerate(new_token_ids):
        stop = stock(detokenizer, [token_id], stop_terminated and i == last)
        if stop is not None:
            del new_token_ids[i + 1 :]
            return stop
    return None


def _probe_detokenizer() -> Any:
    from vllm.v1.engine.detokenizer import BaseIncrementalDetokenizer

    class Letters(BaseIncrementalDetokenizer):
        def decode_next(self, next_token_id: int) -> str:
            return "abc"[next_token_id]

    params = SimpleNamespace(stop=["b"], min_tokens=0, include_stop_str_in_output=False)
    return Letters(SimpleNamespace(sampling_params=params))


def probe() -> bool:
    """Does the stock update keep the tokens after a stop string of a step?"""
    from vllm.v1.engine.detokenizer import BaseIncrementalDetokenizer

    detokenizer = _probe_detokenizer()
    tokens = [0, 1, 2]  # "a", "b" (the stop string), "c"
    stop = original(BaseIncrementalDetokenizer.update)(detokenizer, tokens, False)
    return stop == "b" and len(detokenizer.output_token_ids) == 3


def apply() -> None:
    from vllm.v1.engine.detokenizer import BaseIncrementalDetokenizer
    from vllm.v1.engine.logprobs import LogprobsProcessor

    stock_update = BaseIncrementalDetokenizer.update

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        if len(new_token_ids) < 2 or not self.stop or not dflash_in_use():
            return stock_update(self, new_token_ids, stop_terminated)
        return update_per_token(stock_update, self, new_token_ids, stop_terminated)

    stock_logprobs = LogprobsProcessor.update_from_output

    def update_from_output(self, output: Any) -> None:
        rows = output.new_logprobs
        if rows is not None and len(rows.logprobs) > len(output.new_token_ids):
            # the tokens after a stop string were cut from this step
            keep = len(output.new_token_ids)
            output.new_logprobs = rows._replace(
                logprob_token_ids=rows.logprob_token_ids[:keep],
                logprobs=rows.logprobs[:keep],
                sampled_token_ranks=rows.sampled_token_ranks[:keep],
            )
        stock_logprobs(self, output)

    replace_attr(BaseIncrementalDetokenizer, "update", update, NAME)
    replace_attr(LogprobsProcessor, "update_from_output", update_from_output, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FIX,
    targets=(_DETOKENIZER, _LOGPROBS),
    summary="DFlash: a stop string completed inside a multi-token step ends the "
    "request's tokens and logprobs at that token, as without speculation.",
    why="The detokenizer checks stop strings once per step and truncates only the "
    "text: the accepted draft tokens after the stop string stay in token_ids, "
    "logprobs and usage.completion_tokens (11 vs 10 without speculation).",
    upstream="vllm-project/vllm#47616 (open: trim token_ids/logprobs past a stop "
    "string under speculative decoding)",
    versions=V020,
    platforms=ALL_PLATFORMS,
    probe=probe,
    apply=apply,
    future="Drop when upstream trims the tokens past a stop string (#47616); the "
    "probe then reports it not needed.",
    probe_false_reason="the detokenizer already drops the tokens after a stop string",
)
