# SPDX-License-Identifier: Apache-2.0
"""vLLM's rejection sampler with its CPU fallbacks keeps the target distribution.

Kernel-level (no engine, seconds): ``apply_sampling_constraints`` (temperature,
top-k, top-p expanded per draft token by ``expand_kernel``) and ``rejection_sample``
(accept / recover with ``sample_recovered_tokens``) run on CPU with the fallbacks
``CPUModelRunner.__init__`` installs and the plugin's patches of them. DFlash drafts
are greedy (no draft probabilities), so the first output token of a verified block
must follow the processed target distribution exactly, whatever the draft: draft
``d`` is accepted with probability ``p(d)``, otherwise a token is drawn from ``p``
without ``d``. Each case draws N = 6000 blocks (drafts of high and of low target
probability, so both acceptance and recovery run) and compares the first tokens with
the float64 distribution (chi-square, alpha 1e-6: see tests/helpers/stats.py).

Power: with N = 6000 over 16 tokens, moving 5% of the mass (TV 0.05) between two
tokens of probability ~0.1 adds ~N * 2 * 0.05^2 / 0.1 = 300 to a statistic whose
1e-6 threshold is ~55 (df 15): such a bias fails with probability > 0.999. The CPU
defect this guards (``cpu_expand_kernel_float``) gives TV ~0.9.

Also run by ci/matrix.py's smoke on every pinned vLLM, so the vLLM 0.23
``use_fp64_gumbel`` path (float64 exponential race, passed to the CPU fallback by
``cpu_recovered_tokens_args``) is checked there: distribution unchanged.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.stats import fit

V = 16  # vocabulary
K = 3  # draft tokens per block
N = 6000  # blocks per case

# (temperature, top_k, top_p); top_p values sit between cumulative masses.
CASES = {
    "t0.6": (0.6, None, None),
    "t1.0": (1.0, None, None),
    "t1.3-topk5": (1.3, 5, None),
    "t1.0-topp": (1.0, None, "mid"),
}
PATCHES = (
    "cpu_rejection_sampler_args",
    "cpu_recovered_tokens_args",
    "cpu_expand_kernel_float",
)


def _cpu_sampler(monkeypatch):
    """The rejection sampler module as a CPU worker sees it (plugin patches on,
    VLLM_DFLASH_DISABLE honoured)."""
    import vllm._custom_ops  # noqa: F401  (CPU ops)
    import vllm.v1.sample.rejection_sampler as rs
    from vllm.utils import cpu_triton_utils as cpu_tl

    from vllm_dflash.catalog import PATCHES as ALL
    from vllm_dflash.registry import evaluate

    for p in ALL:
        if p.name in PATCHES:
            evaluate(p, apply=True)
    # What CPUModelRunner.__init__ does.
    for name in (
        "rejection_greedy_sample_kernel",
        "rejection_random_sample_kernel",
        "expand_kernel",
        "sample_recovered_tokens_kernel",
    ):
        monkeypatch.setattr(rs, name, getattr(cpu_tl, name))
    return rs


def _processed(logits: torch.Tensor, temp: float, top_k, top_p) -> torch.Tensor:
    """float64 target distribution after temperature, top-k, top-p."""
    x = logits.to(torch.float64) / temp
    if top_k is not None:
        kth = x.topk(top_k).values[-1]
        x = torch.where(x >= kth, x, torch.tensor(-torch.inf, dtype=x.dtype))
    p = x.softmax(-1)
    if top_p is not None:
        sp, idx = p.sort(descending=True)
        keep_sorted = (sp.cumsum(0) - sp) < top_p  # smallest prefix reaching top_p
        keep = torch.zeros_like(p, dtype=torch.bool)
        keep[idx[keep_sorted]] = True
        p = torch.where(keep, p, 0.0)
        p = p / p.sum()
    return p


def _mid_top_p(logits: torch.Tensor, temp: float) -> float:
    """A top_p halfway between the 4th and 5th cumulative masses (no knife edge)."""
    sp = (logits.to(torch.float64) / temp).softmax(-1).sort(descending=True).values
    c = sp.cumsum(0)
    return float((c[3] + c[4]) / 2)


def _fp64_options(rs) -> list[bool]:
    params = inspect.signature(rs.rejection_sample).parameters
    return [False, True] if "use_fp64_gumbel" in params else [False]


def _run_case(rs, logits, temp, top_k, top_p, drafts, fp64):
    """N blocks of K drafts, all with the same target logits per position."""
    batch = N
    target_logits = logits.repeat(batch, 1)  # [batch*K, V] (positions cycle)
    draft = drafts.repeat(batch)  # [batch*K]
    cu = torch.arange(1, batch + 1, dtype=torch.int32) * K
    md = SimpleNamespace(
        all_greedy=False,
        all_random=True,
        temperature=torch.full((batch,), temp, dtype=torch.float32),
        top_k=None if top_k is None else torch.full((batch,), top_k, dtype=torch.int32),
        top_p=None
        if top_p is None
        else torch.full((batch,), top_p, dtype=torch.float32),
        generators={},
    )
    processed = rs.apply_sampling_constraints(target_logits.clone(), cu, md)
    bonus = torch.full((batch, 1), V - 1, dtype=torch.int64)
    kwargs = {"use_fp64_gumbel": True} if fp64 else {}
    out = rs.rejection_sample(
        draft, [K] * batch, K, cu, None, processed, bonus, md, **kwargs
    )
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_first_verified_token_follows_target(monkeypatch, case):
    rs = _cpu_sampler(monkeypatch)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(K, V, generator=g).to(torch.float32)
    temp, top_k, top_p = CASES[case]
    if top_p == "mid":
        top_p = _mid_top_p(logits[0], temp)
    p0 = _processed(logits[0], temp, top_k, top_p)
    # Draft 0: the token whose target probability is nearest 0.3 (accepted and
    # rejected often); later drafts: the most likely token at their position.
    drafts = torch.stack(
        [(p0 - 0.3).abs().argmin(), logits[1].argmax(), logits[2].argmax()]
    )
    for fp64 in _fp64_options(rs):
        torch.manual_seed(1234)
        out = _run_case(rs, logits, temp, top_k, top_p, drafts, fp64)
        first = out[:, 0].tolist()
        accepted = sum(t == int(drafts[0]) for t in first) / N
        res = fit(first, p0)
        assert res.ok(), (
            f"{case} fp64_gumbel={fp64}: first verified token does not follow "
            f"the target: {res} (draft accepted {accepted:.3f}, "
            f"target p(draft) = {float(p0[drafts[0]]):.3f})"
        )
        # Acceptance and recovery both ran (p(draft) is well inside (0, 1)).
        assert 0.05 < accepted < 0.95, (case, accepted)
        # Second token, given the first draft was accepted: the target at
        # position 1 (same processing).
        p1 = _processed(logits[1], temp, top_k, top_p)
        second = [int(r[1]) for r in out if int(r[0]) == int(drafts[0])]
        res1 = fit(second, p1)
        assert res1.ok(), f"{case} fp64_gumbel={fp64}: second token: {res1}"


def test_expand_kernel_float_values(monkeypatch):
    """The behavioural probe's case through the sampler's own helper."""
    rs = _cpu_sampler(monkeypatch)
    x = torch.tensor([1.0, 0.7, 1.3, 0.0])
    cu = torch.tensor([2, 3, 3, 6], dtype=torch.int32)
    got = rs.expand_batch_to_tokens(x, cu, 6, replace_from=0, replace_to=1)
    assert got.tolist() == pytest.approx([1.0, 1.0, 0.7, 1.0, 1.0, 1.0])
    k = torch.tensor([5, 7, 9, 2], dtype=torch.int32)
    assert rs.expand_batch_to_tokens(k, cu, 6).tolist() == [5, 5, 7, 2, 2, 2]
