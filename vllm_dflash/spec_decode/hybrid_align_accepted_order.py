# SPDX-License-Identifier: Apache-2.0
"""Prefix caching on hybrid targets with async scheduling: each row keeps its own
accepted-token count.

With prefix caching, a hybrid (Gated-DeltaNet) target runs the 'align' mamba
cache mode. There, after each step, vLLM 0.20.x writes the accepted-token counts
into ``InputBatch.num_accepted_tokens_cpu`` on the host, synchronously
(``_update_states_after_model_execute``: ``.cpu()`` then ``postprocess_mamba``).
The next step's ``_update_states`` moves batch rows (``add_request``,
``swap_states``, ``condense``), and the counts move with their rows: they are
in the new row order. ``_prepare_inputs`` then, with asynchronous scheduling
(vLLM's default on CUDA), maps them once more through ``prev_positions`` (new row
-> previous row), a mapping meant for counts still in the previous order. Every
row that moved reads another request's count, which ``preprocess_mamba`` uses
to pick the GDN state to copy and the verify kernel uses as its initial state
slot: wrong tokens, nothing raised. Measured on an H200 (tiny hybrid pair,
float32, 2026-12-04): 10 of 40 outputs differ from the same engine without
prefix caching, all with synchronous scheduling and on the CPU backend equal.

The patch restores, after ``_prepare_inputs``, the host counts it found on entry
(the counts of rows new to the batch are already 1, from ``add_request``);
``preprocess_mamba``, which runs next in 'align' mode, copies them to the
device. Only in DFlash engines on hybrid targets in 'align' mode with
asynchronous scheduling, on steps after a previous batch. Upstream: the second
half of vllm-project/vllm#53919 (open), which removes the mapping; its first
half (wait for the device-to-host copy before the row moves) is for vLLM
versions whose align path copies the counts asynchronously, which 0.20.x does
not.
"""

from __future__ import annotations

from typing import Any

from vllm_dflash.registry import V020_ONLY, Patch, PatchKind, code_reads, replace_attr
from vllm_dflash.spec_decode import uses_dflash

NAME = "dflash_align_accepted_counts_order"
_APPLIES = "_vllm_dflash_align_counts_order"


def runner_applies(runner: Any) -> bool:
    """DFlash, hybrid target, 'align' mode, asynchronous scheduling."""
    return (
        uses_dflash(runner)
        and bool(getattr(runner.model_config, "is_hybrid", False))
        and runner.cache_config.mamba_cache_mode == "align"
        and bool(getattr(runner, "use_async_scheduling", False))
    )


def probe() -> bool:
    """vLLM's _prepare_inputs still maps the host counts through prev_positions
    and its 'align' path still writes them synchronously after each step."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    prepare = GPUModelRunner._prepare_inputs
    after = GPUModelRunner._update_states_after_model_execute
    return (
        code_reads(prepare, "prev_positions")
        and code_reads(prepare, "num_accepted_tokens_cpu")
        and code_reads(after, "postprocess_mamba")
        and code_reads(after, "num_accepted_tokens_cpu")
    )


def apply() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock = GPUModelRunner._prepare_inputs

    def _prepare_inputs(self, *args, **kwargs):
        applies = getattr(self, _APPLIES, None)
        if applies is None:  # decided once per runner
            applies = runner_applies(self)
            setattr(self, _APPLIES, applies)
        batch = self.input_batch
        if not applies or not batch.prev_req_id_to_index:
            return stock(self, *args, **kwargs)
        n = batch.num_reqs
        counts = batch.num_accepted_tokens_cpu[:n].copy()  # row order, after moves
        out = stock(self, *args, **kwargs)
        batch.num_accepted_tokens_cpu[:n] = counts
        return out

    replace_attr(GPUModelRunner, "_prepare_inputs", _prepare_inputs, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FIX,
    targets=("vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs",),
    summary=(
        "Prefix caching on hybrid targets with async scheduling: every batch row "
        "keeps its own accepted-token count (GDN state slot) across row moves."
    ),
    why=(
        "In 'align' mode the host counts are already in the new row order when "
        "_prepare_inputs maps them through prev_positions again: moved rows read "
        "another request's count and start from the wrong GDN state (H200: 10 of 40 "
        "outputs differed)."
    ),
    upstream="vllm-project/vllm#53919 (open), its second half",
    versions=V020_ONLY,  # 0.20.x: the align path writes the counts synchronously
    platforms=("cuda", "cpu"),
    probe=probe,
    apply=apply,
    future="Drop when vLLM's _prepare_inputs stops re-mapping the counts (vllm#53919).",
    probe_false_reason="_prepare_inputs no longer maps the accepted counts through "
    "prev_positions",
)
