# SPDX-License-Identifier: Apache-2.0
"""No multimodal-embedding gather for the DFlash drafter (all platforms).

After the target forward, ``GPUModelRunner.propose_draft_token_ids`` gathers the
step's image embeddings again for the drafter, one token ahead
(``_gather_mm_embeddings(scheduler_output, shift_computed_tokens=1)``), because an
EAGLE drafter embeds the target's next tokens. The scheduler encodes images for the
target's token range only, so when a prefill chunk ends just before an image, the
look-ahead reaches the image's first token, which is not encoded yet: "Encoder
cache miss", and the engine core dies (vLLM #46315 fixes this for every EAGLE-style
method, not in 0.20.x; #53451 open). Seen here with DFlash on the tiny Qwen3.5
hybrid (CPU, trained drafter: a prompt with two images, chunked prefill, at step
budgets 40, 48 and 56; tests/e2e/test_hybrid_images.py).

DFlash does not need that gather at all: its drafter embeds only the newest token
and the mask tokens (``DFlashProposer.build_model_inputs_first_pass`` passes
``inputs_embeds=None`` and never reads ``mm_embed_inputs``; the image reaches the
drafter through the target's hidden states). So for DFlash engines the look-ahead
call returns an empty gather (no embeddings, no multimodal positions) without
reading the encoder cache: no crash and less work per step. The target's own
gather (``shift_computed_tokens=0``) is unchanged, and so is every other method.

Probe (behavioural): vLLM's own ``_gather_mm_embeddings`` on a stand-in runner whose
request's prefill chunk ends right before an image that is not encoded: the stock
look-ahead raises the cache miss. The patch also checks, on a stand-in, that this
vLLM's DFlash first pass ignores ``mm_embed_inputs``; if it reads them, the patch
refuses to apply (loudly) instead of dropping embeddings the drafter uses.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_dflash.logger import init_logger
from vllm_dflash.registry import Patch, PatchKind, original, replace_attr
from vllm_dflash.spec_decode import uses_dflash

logger = init_logger(__name__)

PATCH_NAME = "dflash_no_drafter_mm_gather"


def _runner_cls():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner


def boundary_case():
    """(runner stand-in, scheduler output): one request prefills 4 tokens that end
    right before a 4-token image; the encoder cache is empty (the scheduler encodes
    images for the target's range only, and this chunk does not reach the image)."""
    from vllm.multimodal.inputs import PlaceholderRange

    feature = SimpleNamespace(
        mm_position=PlaceholderRange(offset=4, length=4), identifier="probe-image"
    )
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=["probe"]),
        requests={
            "probe": SimpleNamespace(num_computed_tokens=0, mm_features=[feature])
        },
        encoder_cache={},
        is_multimodal_pruning_enabled=False,
        uses_mrope=False,
        speculative_config=SimpleNamespace(method="dflash", use_dflash=lambda: True),
    )
    sched = SimpleNamespace(
        total_num_scheduled_tokens=4, num_scheduled_tokens={"probe": 4}
    )
    return runner, sched


def stock_lookahead_misses() -> bool:
    """vLLM's look-ahead gather (shift 1) raises on the boundary case."""
    gather = original(_runner_cls()._gather_mm_embeddings)
    runner, sched = boundary_case()
    gather(runner, sched, shift_computed_tokens=0)  # the target's range: no image
    try:
        gather(runner, sched, shift_computed_tokens=1)
    except AssertionError as e:
        if "Encoder cache miss" in str(e):
            return True
        raise
    return False


class _Touched(Exception):
    pass


class _Untouchable:
    """Stands for ``mm_embed_inputs``: any use of it raises."""

    def __getattr__(self, name):
        raise _Touched(name)

    def __iter__(self):
        raise _Touched("__iter__")

    def __bool__(self):
        raise _Touched("__bool__")

    def __getitem__(self, item):
        raise _Touched("__getitem__")


def dflash_first_pass_ignores_mm_inputs() -> bool:
    """Run this vLLM's ``DFlashProposer.build_model_inputs_first_pass`` on a stand-in
    with an ``mm_embed_inputs`` that raises when used."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    fake = SimpleNamespace(
        _dflash_num_context=0,
        _dflash_hidden_states=torch.zeros(0, 1),
        _context_positions_buffer=torch.zeros(1, dtype=torch.long),
        _context_slot_mapping_buffer=torch.zeros(1, dtype=torch.long),
        model=SimpleNamespace(precompute_and_store_context_kv=lambda *a, **k: None),
        input_ids=torch.zeros(4, dtype=torch.long),
        _get_positions=lambda n: torch.zeros(n, dtype=torch.long),
        supports_mm_inputs=True,
    )
    try:
        DFlashProposer.build_model_inputs_first_pass(fake, 1, 1, _Untouchable())
    except _Touched:
        return False
    return True


def probe() -> bool:
    return stock_lookahead_misses()


def apply() -> None:
    if not dflash_first_pass_ignores_mm_inputs():
        raise RuntimeError(
            f"{PATCH_NAME}: this vLLM's DFlashProposer reads mm_embed_inputs; "
            "dropping the drafter's multimodal gather would change its drafts"
        )
    cls = _runner_cls()
    stock = original(cls._gather_mm_embeddings)

    def _gather_mm_embeddings(self, scheduler_output, shift_computed_tokens=0):
        if shift_computed_tokens and uses_dflash(self):
            n = scheduler_output.total_num_scheduled_tokens
            return [], torch.zeros(n, dtype=torch.bool, device="cpu")
        return stock(self, scheduler_output, shift_computed_tokens)

    replace_attr(cls, "_gather_mm_embeddings", _gather_mm_embeddings, PATCH_NAME)


PATCH = Patch(
    name=PATCH_NAME,
    kind=PatchKind.FIX,
    targets=("vllm.v1.worker.gpu_model_runner:GPUModelRunner._gather_mm_embeddings",),
    summary=(
        "DFlash: the drafter's look-ahead multimodal-embedding gather is skipped "
        "(the DFlash drafter never reads it)."
    ),
    why=(
        "The look-ahead gather (shift_computed_tokens=1) reads an image the scheduler "
        "has not encoded yet when a prefill chunk ends just before it: 'Encoder cache "
        "miss' kills the engine (multimodal prompts with accepted drafts)."
    ),
    upstream="vllm-project/vllm#46315 (EAGLE-style drafters; not in 0.20.x)",
    versions=">=0.20.0,<0.24.0",
    platforms=("cuda", "cpu"),
    probe=probe,
    apply=apply,
    future="Drop when the running vLLM's look-ahead gather no longer misses (the probe).",
    probe_false_reason=(
        "the look-ahead gather does not read images beyond the scheduled range"
    ),
)
