# SPDX-License-Identifier: Apache-2.0
"""Goodness of fit of sampled tokens against an exact (float64) distribution.

Pearson's chi-square test: tokens whose expected count is below ``min_expected``
are pooled into one bin (the chi-square approximation needs expected counts of a
few or more), the p-value comes from the regularised upper incomplete gamma
function (no scipy). A test fails when the p-value is below ``ALPHA``: with
``ALPHA = 1e-6`` a correct sampler fails one check in a million, while a bias
adds about ``N * sum((q - p)^2 / p)`` to the statistic (N samples, q the biased
distribution), so biases of a few percent of total variation fail with
thousands of samples (each test states its own power).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

ALPHA = 1e-6


@dataclass(frozen=True)
class Fit:
    n: int
    chi2: float
    df: int
    p_value: float
    tv: float  # total variation between the empirical and exact distributions

    def ok(self, alpha: float = ALPHA) -> bool:
        return self.p_value >= alpha

    def __str__(self) -> str:
        return (
            f"n={self.n} chi2={self.chi2:.1f} df={self.df} "
            f"p={self.p_value:.3g} tv={self.tv:.4f}"
        )


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df)."""
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64),
            torch.tensor(x / 2, dtype=torch.float64),
        )
    )


def fit(
    samples: list[int] | Counter,
    probs: torch.Tensor,
    min_expected: float = 5.0,
    pruned_mass: float = 0.0,
) -> Fit:
    """Chi-square fit of ``samples`` (token ids) to ``probs`` ([V], float64).

    ``pruned_mass``: probability the exact computation left out (bounded, tiny);
    it is added to the pooled bin, so a sample of a token outside ``probs``'s
    support is an error only when it is not explained by that mass.
    """
    counts = samples if isinstance(samples, Counter) else Counter(samples)
    n = sum(counts.values())
    p = probs.to(torch.float64).clone()
    obs = torch.zeros_like(p)
    for tok, c in counts.items():
        obs[tok] += c
    tv = 0.5 * float((obs / n - p).abs().sum())
    expected = p * n
    big = expected >= min_expected
    e = expected[big].tolist()
    o = obs[big].tolist()
    e_rest = float(expected[~big].sum()) + pruned_mass * n
    o_rest = float(obs[~big].sum())
    if e_rest >= 1e-12:
        e.append(e_rest)
        o.append(o_rest)
    elif o_rest > 0:  # a token with (numerically) zero probability was sampled
        return Fit(n, float("inf"), max(len(e) - 1, 1), 0.0, tv)
    chi2 = sum((oi - ei) ** 2 / ei for oi, ei in zip(o, e, strict=True))
    df = max(len(e) - 1, 1)
    return Fit(n, chi2, df, chi2_sf(chi2, df), tv)


def homogeneity(a: list[int], b: list[int], min_expected: float = 5.0) -> Fit:
    """Chi-square test that two samples of token ids come from one distribution
    (Pearson's test of a 2 x K contingency table). Tokens whose expected count
    in the smaller sample is below ``min_expected`` are pooled into one bin.
    ``tv``: the total variation between the two empirical distributions."""
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    n = na + nb
    rows, rest_a, rest_b = [], 0, 0
    for tok in set(ca) | set(cb):
        if (ca[tok] + cb[tok]) * min(na, nb) / n >= min_expected:
            rows.append((ca[tok], cb[tok]))
        else:
            rest_a, rest_b = rest_a + ca[tok], rest_b + cb[tok]
    if rest_a + rest_b:
        rows.append((rest_a, rest_b))
    chi2 = 0.0
    for oa, ob in rows:
        ea, eb = (oa + ob) * na / n, (oa + ob) * nb / n
        chi2 += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    df = max(len(rows) - 1, 1)
    tv = 0.5 * sum(abs(ca[t] / na - cb[t] / nb) for t in set(ca) | set(cb))
    return Fit(n, chi2, df, chi2_sf(chi2, df), tv)
