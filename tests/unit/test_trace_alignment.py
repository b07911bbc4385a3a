# SPDX-License-Identifier: Apache-2.0
"""Trace records vs the run's sequences: tokens the trace could not see."""

from __future__ import annotations

from tests.helpers.equivalence import UNSEEN, aligned


def test_unseen_tokens_match_anything_but_the_newest_must_be_known():
    seq = [5, 81, 10, 489, 351]
    assert aligned(seq, [81, 10, 489, 351])
    # H200, async scheduling: the history missed position 2 (2026-12-02)
    assert aligned(seq, [81, UNSEEN, 489, 351])
    assert not aligned(seq, [81, 11, 489, 351])  # a known token differs
    assert not aligned(seq, [10, 489, 351, 422])  # shifted by one
    assert not aligned(seq, [81, 10, 489, UNSEEN])  # newest unknown
    assert not aligned(seq[:2], [81, 10, 489, 351])  # record longer than seq
