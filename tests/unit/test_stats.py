# SPDX-License-Identifier: Apache-2.0
"""The two-sample test of tests/helpers/stats.py: calibrated on equal
distributions; a shift of 0.1 total variation (N = 1200 each, alpha = 1e-6)
fails it in most draws."""

from __future__ import annotations

import torch

from tests.helpers.stats import ALPHA, homogeneity


def _draw(p: torch.Tensor, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(p, n, replacement=True, generator=g).tolist()


P = torch.tensor([0.55, 0.2, 0.1, 0.05, 0.04, 0.03, 0.02, 0.01])
P = P / P.sum()


def test_equal_distributions_pass():
    p_values = [
        homogeneity(_draw(P, 1200, s), _draw(P, 1200, 1000 + s)).p_value
        for s in range(40)
    ]
    assert min(p_values) > ALPHA
    # Roughly uniform p-values: about half below 0.5.
    assert 8 <= sum(p < 0.5 for p in p_values) <= 32


def test_a_shift_of_tv_0_1_fails():
    q = P.clone()
    q[0] -= 0.1
    q[1] += 0.1
    fails = sum(
        not homogeneity(_draw(P, 1200, s), _draw(q, 1200, 500 + s)).ok()
        for s in range(10)
    )
    assert fails >= 6  # 7 of 10 at these seeds


def test_disjoint_supports_fail_and_tv():
    r = homogeneity([1] * 50 + [2] * 50, [3] * 50 + [4] * 50)
    assert not r.ok() and r.tv == 1.0
