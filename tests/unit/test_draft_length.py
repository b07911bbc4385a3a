# SPDX-License-Identifier: Apache-2.0
"""Adaptive draft length: the policy, the config key, the scheduler controller
and the drafter's context-only pass (the engine runs are in
tests/e2e/test_draft_length.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_dflash.config import draft_length as cfg
from vllm_dflash.config.layer_types import DrafterConfigError
from vllm_dflash.core import adaptive_draft_length as adl
from vllm_dflash.core.draft_length_policy import (
    DraftLengthPolicy,
    bucket_of,
    default_candidates,
)
from vllm_dflash.spec_decode import (
    context_only_pass,
    partial_draft_head,
    short_draft_block,
)


# -- policy -------------------------------------------------------------------
def roofline(num_reqs: int, d: int) -> float:
    """Step seconds: weight-bound floor 10 ms, then 50 us per verified token; the
    drafter's query pass (d > 0) grows with the batch, its context pass is cheap."""
    drafter = 0.001 * (1 + num_reqs * 16 / 512) if d else 0.0002
    return max(0.010, num_reqs * (1 + d) * 5e-5) + drafter


def simulate(policy, num_reqs, q, steps, noise, rng):
    """Steps with per-position acceptance q; returns (tokens/s, lengths chosen)."""
    tokens = seconds = 0.0
    chosen = []
    for _ in range(steps):
        d = policy.choose(num_reqs)
        chosen.append(d)
        accepted = np.minimum(rng.geometric(1 - q, size=num_reqs) - 1, d)
        policy.observe_acceptance(np.full(num_reqs, d), accepted)
        dt = roofline(num_reqs, d) * (1 + noise * rng.standard_normal())
        policy.observe_step(num_reqs, d, dt)
        tokens += num_reqs + accepted.sum()
        seconds += dt
    return tokens / seconds, chosen


def ideal(policy, num_reqs, q):
    def rate(d):
        return (
            num_reqs * (1 + sum(q**j for j in range(1, d + 1))) / roofline(num_reqs, d)
        )

    best = max(policy.candidates, key=rate)
    return best, rate(best), rate(policy.k)


@pytest.mark.parametrize("q", [0.6, 0.8])
def test_policy_finds_the_best_length_per_batch_size(q):
    """Batches grow as in a benchmark sweep; at each size the policy ends on the
    best length (or next to it) and its throughput is within 5% of the best
    fixed length's less its exploration (5%), with 2% noise on every step time."""
    rng = np.random.default_rng(0)
    policy = DraftLengthPolicy(15)
    for num_reqs in (1, 16, 64, 128, 256):
        got, chosen = simulate(policy, num_reqs, q, 600, 0.02, rng)
        best, best_rate, fixed_rate = ideal(policy, num_reqs, q)
        assert got >= 0.95 * best_rate, (num_reqs, got, best_rate, chosen[:40])
        i = policy.candidates.index(best)
        assert chosen[-1] in policy.candidates[max(0, i - 1) : i + 2], (
            num_reqs,
            chosen,
        )
        if num_reqs == 1:
            assert got >= 0.98 * fixed_rate  # no loss where k is best
    assert policy.describe()["buckets"][9]["current"] == 0  # 256: verify nothing


def test_noisy_medians_do_not_make_a_longer_verify_look_cheaper():
    """The H200's medians at 64-127 requests (2026-12-02, acceptance 3.5: positions
    1-2 accepted, 3 half the time, 4 never): with them taken as they are, 15 drafts
    (30.7 ms) looked cheaper than 8 (56.7 ms) and the policy verified 15. Fitted
    non-decreasing in d, 3, 4 and 6 cost the same (32.5 ms); their scores differ by
    the prior's acceptance of positions 4-6 (< 0.1%), and the shortest, 3, is taken."""
    policy = DraftLengthPolicy(15, acceptance_decay=1.0)
    n = 1000
    policy.observe_acceptance(np.full(n, 15), np.array([2] * (n // 2) + [3] * (n // 2)))
    medians_ms = {2: 31.44, 3: 32.843, 4: 32.594, 6: 32.171, 8: 56.719}
    medians_ms |= {11: 54.2, 15: 30.737}
    for d, ms in medians_ms.items():
        for _ in range(3):
            policy.observe_step(100, d, ms / 1e3)
    for _ in range(policy.probe_samples):  # d = 1 and 0 measured: far worse
        policy.observe_step(100, 1, 0.030)
        policy.observe_step(100, 0, 0.029)
    policy.buckets[7].current = policy.candidates.index(15)  # k, as at start-up
    assert [policy.choose(100) for _ in range(5)] == [3] * 5


@pytest.mark.parametrize("full_graph_tokens", [512, 0])
def test_k_with_a_full_cuda_graph_is_not_fitted(full_graph_tokens):
    """The H200's medians at one and at 16-31 requests (2026-12-02, acceptance
    3.5): 15 drafts run as the target's full CUDA graph and cost less than any
    shorter length. Fitted with the others (no full graphs known), 15 looks as
    slow as them and a shorter length is kept (the run verified 6 and 3 drafts:
    1.30-1.96x no speculation at one request, fixed k gives ~2.4x); with the
    graph limit known, k keeps its own time and is chosen."""
    policy = DraftLengthPolicy(
        15, acceptance_decay=1.0, full_graph_tokens=full_graph_tokens
    )
    n = 1000
    policy.observe_acceptance(np.full(n, 15), np.array([2] * (n // 2) + [3] * (n // 2)))
    one = {2: 9.143, 3: 10.752, 4: 10.304, 6: 8.118, 8: 8.601, 11: 12.939, 15: 7.055}
    sixteen = {2: 13.567, 3: 14.064, 4: 10.57, 6: 14.904, 8: 14.994, 11: 14.162}
    sixteen[15] = 10.038
    # requests: (the length the run was verifying there, medians in ms)
    for num_reqs, (current, medians_ms) in {1: (6, one), 16: (3, sixteen)}.items():
        for d, ms in medians_ms.items():
            for _ in range(3):
                policy.observe_step(num_reqs, d, ms / 1e3)
        for _ in range(policy.probe_samples):  # 1 and 0 drafts: far worse
            policy.observe_step(num_reqs, 1, 0.030)
            policy.observe_step(num_reqs, 0, 0.029)
        policy._bucket(bucket_of(num_reqs)).current = policy.candidates.index(current)
        chosen = {policy.choose(num_reqs) for _ in range(5)}
        assert chosen == ({15} if full_graph_tokens else {current}), (num_reqs, chosen)
    # 64 requests x 16 tokens is above the graph limit: k is fitted as before
    assert policy._bucket(5).graph_k == bool(full_graph_tokens)  # 16-31: <= 496
    assert not policy._bucket(6).graph_k  # 32-63: 33 x 16 = 528 tokens have none


def test_a_bucket_without_full_graphs_does_not_start_from_k():
    """16-31 requests x 16 tokens fit a full CUDA graph, 64 x 16 do not: the
    first bucket's k (cheap by its graph) is not where 64 requests start."""
    chosen = {}
    for full_graph_tokens in (512, 0):
        policy = DraftLengthPolicy(
            15, acceptance_decay=1.0, full_graph_tokens=full_graph_tokens
        )
        # every draft accepted: k's expected tokens are far above any shorter
        # length's (no acceptance knee below k)
        policy.observe_acceptance(np.full(1000, 15), np.full(1000, 15))
        for d, ms in {2: 16.0, 3: 15.0, 4: 15.5, 15: 12.0}.items():
            for _ in range(3):
                policy.observe_step(20, d, ms / 1e3)
        policy._bucket(5).current = policy.candidates.index(15)  # chosen there
        chosen[full_graph_tokens] = policy.choose(64)
    # with graphs: the best shorter length at 16-31; without: k
    assert chosen == {512: 4, 0: 15}, chosen


# The H200's step medians at 64 requests, acceptance 3.5 (2026-12-02, first
# batch: ms per draft length).
H200_64_MS = {0: 14.265, 1: 17.133, 2: 14.172, 3: 10.309, 4: 14.531, 6: 15.336}
H200_64_MS |= {8: 30.972, 11: 29.602, 15: 29.412}


@pytest.mark.parametrize("knee", [True, False])
def test_a_new_bucket_does_not_probe_drafts_that_are_not_accepted(knee, monkeypatch):
    """H200, 2026-12-02 (acceptance 3.5: positions 1-2 accepted, 3 half the time,
    4 never): the first batch of 64 requests started from 32-63's 11 drafts and
    probed 11, 8 and 15 at 29-31 ms a step where 3 took 10 ms (0.88x no
    speculation). Those lengths add no expected tokens over 3 and cost no less:
    a new bucket starts at the acceptance knee (3) and never probes above it
    (4 adds nothing either: position 4 is never accepted).
    With the two rules off (``knee=False``) the old walk comes back."""
    if not knee:
        monkeypatch.setattr(DraftLengthPolicy, "_knee", lambda self, i: i)
        monkeypatch.setattr(
            DraftLengthPolicy, "_gains_over", lambda self, bucket, gains, i, j: True
        )
    policy = DraftLengthPolicy(15, acceptance_decay=1.0, full_graph_tokens=512)
    n = 1000
    policy.observe_acceptance(np.full(n, 15), np.array([2] * (n // 2) + [3] * (n // 2)))
    for _ in range(3):  # 32-63 requests: 11 measured and chosen
        policy.observe_step(48, 11, 0.0149)
    policy._bucket(6).current = policy.candidates.index(11)
    chosen = []
    for _ in range(60):
        d = policy.choose(64)
        chosen.append(d)
        policy.observe_step(64, d, H200_64_MS[d] / 1e3)
    probed = set(chosen)
    if knee:
        assert chosen[0] == 3 and max(probed) == 3, chosen
        assert chosen[-10:] == [3] * 10, chosen
    else:
        assert chosen[0] == 11 and {8, 15} <= probed, chosen


def test_a_longer_length_with_accepted_drafts_is_still_probed():
    """The rule only skips lengths whose extra drafts add no expected tokens: with
    every draft accepted, a bucket that starts at 3 still climbs to k."""
    policy = DraftLengthPolicy(15, acceptance_decay=1.0)
    policy.observe_acceptance(np.full(1000, 15), np.full(1000, 15))
    chosen = []
    policy._bucket(bucket_of(4)).current = policy.candidates.index(3)
    for _ in range(80):
        d = policy.choose(4)
        chosen.append(d)
        policy.observe_step(4, d, 0.010 + d * 1e-5)  # weight bound: flat
    assert chosen[-1] == 15 and {4, 6, 8, 11} <= set(chosen), chosen


# The H200's step medians at 256 requests, 27B hybrid pair (2026-12-03, ms per
# draft length: 2-6 measured; 1 and 0 never were). 1: between 0 and 2 on the line
# of 2-4. 0: an estimate, the no-speculation engine's decode step there (its
# batches less the prefill both engines share: ~33 ms) plus the drafter's
# context pass.
H200_HYBRID_256_MS = {0: 36.0, 1: 90.0, 2: 116.385, 3: 141.839, 4: 181.549}
H200_HYBRID_256_MS |= {6: 237.508, 8: 300.0, 11: 390.0, 15: 510.0}


@pytest.mark.parametrize("zero_probe", [True, False])
def test_zero_drafts_are_probed_where_the_walk_stops_above_them(
    zero_probe, monkeypatch
):
    """H200, 2026-12-03 (27B hybrid pair, 256 requests, acceptance 3.5): the
    bucket started at 2 drafts (the 128-255 bucket's), found 1 clearly worse and
    stopped walking down, so 0 drafts, a step without the drafter's query pass,
    was never measured; 2 drafts ran at 0.96x no speculation. 0 is now probed and
    kept where it wins. With the rule off the walk stops at 1 as before."""
    if not zero_probe:
        monkeypatch.setattr(
            DraftLengthPolicy, "_walks_past", lambda self, bucket, i: False
        )
    policy = DraftLengthPolicy(15, acceptance_decay=1.0, full_graph_tokens=512)
    n = 1000
    policy.observe_acceptance(np.full(n, 15), np.array([2] * (n // 2) + [3] * (n // 2)))
    policy._bucket(bucket_of(256)).current = policy.candidates.index(2)
    chosen = []
    for _ in range(60):
        d = policy.choose(256)
        chosen.append(d)
        policy.observe_step(256, d, H200_HYBRID_256_MS[d] / 1e3)
    if zero_probe:
        assert 0 in chosen and chosen[-10:] == [0] * 10, chosen
    else:
        assert 0 not in chosen and chosen[-10:] == [2] * 10, chosen


@pytest.mark.parametrize("walk_past", [True, False])
def test_a_bucket_at_zero_drafts_finds_longer_drafts_again(walk_past, monkeypatch):
    """A bucket at 0 drafts (the best at first: the 2026-12-03 256-request times)
    re-probes every ``reprobe_every`` steps: from 0 the walk up meets 1 draft,
    clearly worse (it pays the drafter's query pass for one extra token), and
    goes on to 2, which wins once its step time has fallen. With the rule off
    the walk stops at 1 and the bucket stays on 0."""
    if not walk_past:
        monkeypatch.setattr(DraftLengthPolicy, "_walks_past", lambda self, b, i: False)
    policy = DraftLengthPolicy(15, acceptance_decay=1.0, reprobe_every=64)
    policy.observe_acceptance(np.full(1000, 15), np.full(1000, 2))  # 2 accepted
    ms = dict(H200_HYBRID_256_MS)
    policy._bucket(bucket_of(256)).current = 0  # where the zero-draft probe led
    chosen = []
    for step in range(200):
        if step == 100:
            ms |= {2: 60.0, 3: 75.0, 4: 95.0}
        d = policy.choose(256)
        chosen.append(d)
        policy.observe_step(256, d, ms[d] / 1e3)
    assert chosen[90:100] == [0] * 10, chosen
    # between the re-probes at measured steps 128 and 192
    assert chosen[150:190] == [2 if walk_past else 0] * 40, chosen


@pytest.mark.parametrize("full_graph_tokens", [512, 0])
def test_zero_drafts_are_not_probed_where_k_runs_as_a_full_graph(full_graph_tokens):
    """One request, two drafts accepted, the bucket at 2 drafts with 1 clearly
    worse (fewer tokens for the same time): where k runs as a full CUDA graph
    (weight-bandwidth bound: a step of 0 drafts saves next to nothing) the walk
    stops at 1 as before; without full graphs it goes on to 0."""
    policy = DraftLengthPolicy(
        15, acceptance_decay=1.0, full_graph_tokens=full_graph_tokens
    )
    policy.observe_acceptance(np.full(1000, 15), np.full(1000, 2))
    policy._bucket(1).current = policy.candidates.index(2)
    ms = {0: 8.0, 1: 9.0, 15: 7.0}  # 2-11: 9.2-10.1 ms
    chosen = [policy.choose(1)]
    for _ in range(30):
        d = chosen[-1]
        policy.observe_step(1, d, ms.get(d, 9.0 + 0.1 * d) / 1e3)
        chosen.append(policy.choose(1))
    assert (0 in chosen) == (not full_graph_tokens), chosen


def test_full_graph_tokens_from_the_cudagraph_mode():
    from vllm.config import CUDAGraphMode

    def config(mode, size=512):
        cc = SimpleNamespace(cudagraph_mode=mode, max_cudagraph_capture_size=size)
        return SimpleNamespace(compilation_config=cc)

    assert adl.full_graph_tokens(config(CUDAGraphMode.FULL_AND_PIECEWISE)) == 512
    assert adl.full_graph_tokens(config(CUDAGraphMode.FULL_DECODE_ONLY, 256)) == 256
    for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE, CUDAGraphMode.FULL, None):
        assert adl.full_graph_tokens(config(mode)) == 0, mode


def test_shortest_of_near_equal_scores_and_hysteresis():
    """Lengths within 1% of the best score: the shortest. A length that is not
    clearly (margin) better than the current one does not move it."""
    policy = DraftLengthPolicy(4, candidates=(0, 1, 2, 3, 4), acceptance_decay=1.0)
    policy.observe_acceptance(np.full(100, 4), np.full(100, 1))  # 1 accepted
    # E(1) = 1.99, E(2..4) ~ 2.0: same time for 1..4 -> within 1%: 1
    for d, ms in {0: 30.0, 1: 10.0, 2: 10.0, 3: 10.0, 4: 10.0}.items():
        for _ in range(3):
            policy.observe_step(8, d, ms / 1e3)
    bucket = policy.buckets[4]
    bucket.current = 4
    assert policy.choose(8) == 4  # 1 is not 3% better than 4: stay
    bucket.current = 0
    assert policy.choose(8) == 1  # from 0 (far worse): the shortest near-best


def test_monotone_fit():
    from vllm_dflash.core.draft_length_policy import monotone_fit

    assert monotone_fit([1.0, 2.0, 3.0], [1, 1, 1]) == [1.0, 2.0, 3.0]
    assert monotone_fit([1.0, 3.0, 2.0], [1, 1, 1]) == [1.0, 2.5, 2.5]
    assert monotone_fit([4.0, 1.0], [3, 1]) == [3.25, 3.25]
    assert monotone_fit([3.0, 2.0, 1.0], [1, 1, 1]) == [2.0, 2.0, 2.0]
    assert monotone_fit([1.0, 4.0, 2.0, 0.0], [1, 1, 1, 1]) == [1.0, 2.0, 2.0, 2.0]
    assert monotone_fit([2.0, 1.0], [0, 1]) == [1.5, 1.5]  # weight floor 1
    assert monotone_fit([], []) == []


def test_acceptance_counts_only_verified_positions():
    policy = DraftLengthPolicy(4, acceptance_decay=1.0)
    # two requests with 4 drafts: one accepted 2 (position 3 rejected, 4 never
    # verified), one accepted 4; one request with 1 draft, rejected.
    policy.observe_acceptance(np.array([4, 4, 1]), np.array([2, 4, 0]))
    tried = policy.tried - 2.0
    accepted = policy.accepted - 1.0
    assert tried.tolist() == [3, 2, 2, 1]
    assert accepted.tolist() == [2, 2, 1, 1]
    assert policy.expected_tokens(0) == 1.0
    r = policy.conditional_rates()
    assert policy.expected_tokens(2) == pytest.approx(1 + r[0] + r[0] * r[1])


def test_candidates():
    assert default_candidates(15) == (0, 1, 2, 3, 4, 6, 8, 11, 15)
    assert default_candidates(4) == (0, 1, 2, 3, 4)
    assert default_candidates(1) == (0, 1)
    with pytest.raises(ValueError):
        DraftLengthPolicy(0)


# -- config key -----------------------------------------------------------------
def test_split_moves_the_key_out():
    given = {"method": "dflash", "model": "m", "draft_length": "Adaptive"}
    rest, mode = cfg.split(given)
    assert rest == {"method": "dflash", "model": "m"} and mode == "adaptive"
    assert "draft_length" in given  # the caller's dict is left alone
    assert cfg.split({"method": "dflash"}) == ({"method": "dflash"}, None)
    assert cfg.split(None) == (None, None)


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"method": "dflash", "draft_length": "auto"}, ["draft_length='auto'", "fixed", "adaptive"]),
        ({"method": "dflash", "draft_length": 3}, ["draft_length=3", "adaptive"]),
        ({"method": "eagle3", "draft_length": "adaptive"}, ["'dflash' only", "eagle3"]),
    ],
)  # fmt: skip
def test_split_errors_are_one_line(spec, words):
    with pytest.raises(DrafterConfigError) as e:
        cfg.split(spec)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def _vllm_config(dp=1, extra=None):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(method="dflash"),
        parallel_config=SimpleNamespace(
            data_parallel_size=dp, pipeline_parallel_size=1
        ),
        additional_config={} if extra is None else extra,
    )


def test_store_and_mode_of():
    vc = _vllm_config()
    assert cfg.mode_of(vc) == "fixed"
    cfg.store(vc, "adaptive")
    assert vc.additional_config == {"vllm_dflash": {"draft_length": "adaptive"}}
    assert cfg.mode_of(vc) == "adaptive"
    vc.speculative_config.method = "eagle3"
    assert cfg.mode_of(vc) == "fixed"
    with pytest.raises(DrafterConfigError, match="data_parallel_size=2"):
        cfg.store(_vllm_config(dp=2), "adaptive")


def test_engine_args_wrapper_moves_the_key(isolated, monkeypatch):
    """The wrapper hands vLLM the config without the key, restores the caller's
    dict, and stores the mode (vLLM's own EngineArgs with the key: the e2e runs
    and tests/e2e/test_cli.py, in subprocesses)."""
    from vllm.engine.arg_utils import EngineArgs

    isolated(adl.CONFIG_PATCH)
    seen = []

    def stock(self, *a, **k):
        seen.append(self.speculative_config)
        return _vllm_config()

    monkeypatch.setattr(EngineArgs, "create_engine_config", stock)
    adl.config_apply()
    spec = {"method": "dflash", "model": "m", "draft_length": "adaptive"}
    args = SimpleNamespace(speculative_config=dict(spec))
    config = EngineArgs.create_engine_config(args)
    assert seen == [{"method": "dflash", "model": "m"}]
    assert args.speculative_config == spec
    assert cfg.mode_of(config) == "adaptive"
    args.speculative_config = {**spec, "draft_length": "x"}
    with pytest.raises(DrafterConfigError, match="draft_length='x'"):
        EngineArgs.create_engine_config(args)
    assert len(seen) == 1  # refused before vLLM parsed anything


# -- scheduler controller ---------------------------------------------------------
class FakeScheduler:
    """Running requests with draft lists; ``schedule`` schedules each request's
    1 + len(spec_token_ids) tokens (what vLLM's scheduler does for decodes)."""

    def __init__(self, n: int, k: int) -> None:
        self.k = k
        self.running = [
            SimpleNamespace(request_id=f"r{i}", spec_token_ids=list(range(1, k + 1)))
            for i in range(n)
        ]

    def stock_schedule(self, sit_out: tuple[str, ...] = ()):
        """``sit_out``: requests the token budget leaves out of this step (they
        keep their drafts; the drafter pass after this step skips them)."""
        batch = [r for r in self.running if r.request_id not in sit_out]
        spec = {r.request_id: r.spec_token_ids for r in batch if r.spec_token_ids}
        num = {r.request_id: 1 + len(r.spec_token_ids) for r in batch}
        out = SimpleNamespace(
            scheduled_spec_decode_tokens=spec,
            num_scheduled_tokens=num,
            total_num_scheduled_tokens=sum(num.values()),
            scheduled_new_reqs=[],
        )
        for r in batch:  # the worker proposes k drafts for the next step
            r.spec_token_ids = list(range(1, self.k + 1))
        return out


def scripted_policy(wants: list[int], candidates: tuple[int, ...]) -> SimpleNamespace:
    """A policy that wants the given lengths in turn and learns nothing."""
    it = iter(wants)
    return SimpleNamespace(
        choose=lambda n: next(it), candidates=candidates, buckets={},
        observe_step=lambda *a: None, observe_acceptance=lambda *a: None,
    )  # fmt: skip


def test_controller_trims_and_keeps_zero_length_decodes_speculative():
    sched = FakeScheduler(3, 4)
    ctl = adl.DraftLengthController(sched, 4, forced=(2, 0, 0, 4, 3))
    out = ctl.schedule(sched.stock_schedule)
    assert {len(v) for v in out.scheduled_spec_decode_tokens.values()} == {2}
    assert getattr(out, adl.DRAFTS_NEXT_ATTR) == 0  # next is 0: no query pass
    out = ctl.schedule(sched.stock_schedule)  # d = 0
    assert out.scheduled_spec_decode_tokens == {"r0": [], "r1": [], "r2": []}
    assert out.total_num_scheduled_tokens == 3
    assert getattr(out, adl.DRAFTS_NEXT_ATTR) == 0
    out = ctl.schedule(sched.stock_schedule)  # d = 0 again; the next wants 4
    assert getattr(out, adl.DRAFTS_NEXT_ATTR) == 4
    out = ctl.schedule(sched.stock_schedule)  # 4; the next wants 3
    assert {len(v) for v in out.scheduled_spec_decode_tokens.values()} == {4}
    assert getattr(out, adl.DRAFTS_NEXT_ATTR) == 3  # a partial draft head
    assert ctl.steps_by_length == {2: 1, 0: 2, 4: 1}
    assert ctl.rows_by_pass == {"query": 6, "context": 6, "partial": 3}


def test_controller_caps_after_a_context_only_pass():
    """The policy may want drafts again at once; the step after a context-only
    pass has none to verify, so it verifies 0 and asks for drafts."""
    sched = FakeScheduler(2, 4)
    policy = scripted_policy([0, 4, 4], (0, 4))
    ctl = adl.DraftLengthController(sched, 4, policy=policy)
    out = ctl.schedule(sched.stock_schedule)
    assert getattr(out, adl.DRAFTS_NEXT_ATTR) == 0
    out = ctl.schedule(sched.stock_schedule)
    assert out.total_num_scheduled_tokens == 2  # capped at 0
    assert getattr(out, adl.DRAFTS_NEXT_ATTR) == 4
    out = ctl.schedule(sched.stock_schedule)
    assert out.total_num_scheduled_tokens == 2 * 5


def test_controller_caps_at_what_the_drafter_was_told():
    """A longer length than the drafter's head computed waits one step: the
    positions past it are zeros that no step may verify."""
    sched = FakeScheduler(2, 8)
    policy = scripted_policy([2, 6, 6, 6], (2, 6, 8))
    ctl = adl.DraftLengthController(sched, 8, policy=policy)
    outs = [ctl.schedule(sched.stock_schedule) for _ in range(4)]
    lengths = [{len(v) for v in o.scheduled_spec_decode_tokens.values()} for o in outs]
    assert lengths == [{2}, {2}, {6}, {6}]  # step 2 capped at the 2 drafted
    assert [getattr(o, adl.DRAFTS_NEXT_ATTR) for o in outs] == [2, 6, 6, 6]


def test_controller_caps_each_request_at_its_own_drafter_pass():
    """A request that sat out a step holds the drafts of an older pass (zeros
    after what that pass's head computed): it is never verified past them."""
    sched = FakeScheduler(2, 4)
    policy = scripted_policy([1, 4, 4], (1, 4))
    ctl = adl.DraftLengthController(sched, 4, policy=policy)
    ctl.schedule(sched.stock_schedule)  # both: the next pass drafts 1
    out = ctl.schedule(lambda: sched.stock_schedule(sit_out=("r1",)))
    assert {k: len(v) for k, v in out.scheduled_spec_decode_tokens.items()} == {"r0": 1}
    out = ctl.schedule(sched.stock_schedule)  # r0 drafted 4, r1 still holds 1
    assert {k: len(v) for k, v in out.scheduled_spec_decode_tokens.items()} == {
        "r0": 4,
        "r1": 1,
    }


def test_controller_feeds_the_policy():
    sched = FakeScheduler(2, 4)
    ctl = adl.DraftLengthController(sched, 4, forced=(3,))
    outs = [ctl.schedule(sched.stock_schedule) for _ in range(3)]
    for out in outs:
        ctl.observe(
            out,
            SimpleNamespace(
                sampled_token_ids=[[1, 2, 3], [1, 2]],
                req_id_to_index={"r0": 0, "r1": 1},
            ),
        )
    cost = ctl.policy.buckets[2].costs[3]
    assert cost.samples == 2  # the first step (no step before it) is not timed
    rates = ctl.policy.conditional_rates()
    # position 1: both accepted; 3: r0 verified and rejected it; 4: never drafted
    assert rates[0] > 0.5 and rates[2] < 0.5 and rates[3] == 0.5


# -- context-only pass --------------------------------------------------------------
def test_context_only_pass_stores_context_and_drafts_nothing(isolated):
    from vllm.v1.spec_decode.dflash import DFlashProposer

    isolated(context_only_pass.PATCH)
    context_only_pass.apply()
    calls = []
    fake = SimpleNamespace(
        num_speculative_tokens=3, max_batch_size=4, device=torch.device("cpu"),
        model=SimpleNamespace(combine_hidden_states=lambda h: h * 2),
        set_inputs_first_pass=lambda **kw: (calls.append(("inputs", kw)) or (6, None, None)),
        build_model_inputs_first_pass=lambda *a: calls.append(("store", a)),
    )  # fmt: skip
    setattr(fake, context_only_pass.NEXT_DRAFTS_ATTR, 0)
    cad = SimpleNamespace(batch_size=lambda: 2)
    hidden = torch.ones(5, 2)
    drafts = DFlashProposer.propose(
        fake, target_token_ids=torch.zeros(5), target_positions=torch.zeros(5),
        target_hidden_states=hidden, next_token_ids=torch.zeros(2),
        token_indices_to_sample=None, common_attn_metadata=cad,
        sampling_metadata=None, num_rejected_tokens_gpu=None,
    )  # fmt: skip
    assert drafts.shape == (2, 3) and not drafts.any()
    assert [c[0] for c in calls] == ["inputs", "store"]
    assert torch.equal(calls[0][1]["target_hidden_states"], hidden * 2)
    assert calls[1][1] == (6, 6, None)  # the context K/V is stored


def test_runner_passes_the_scheduler_decision_to_the_drafter(isolated, monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    isolated(context_only_pass.PATCH)
    seen = []
    monkeypatch.setattr(
        GPUModelRunner,
        "propose_draft_token_ids",
        lambda self, so, *a, **k: seen.append(
            context_only_pass.next_drafts(self.drafter)
        ),
    )
    context_only_pass.apply()
    runner = SimpleNamespace(drafter=SimpleNamespace())
    GPUModelRunner.propose_draft_token_ids(runner, SimpleNamespace())
    for d in (0, 3):
        out = SimpleNamespace(**{adl.DRAFTS_NEXT_ATTR: d})
        GPUModelRunner.propose_draft_token_ids(runner, out)
    assert seen == [None, 0, 3]


# -- partial draft head -------------------------------------------------------------
def test_partial_draft_head_computes_only_the_verified_positions(isolated):
    """The head's GEMM sees batch*d rows; the d ids are the full head's first d."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    isolated(partial_draft_head.PATCH)
    partial_draft_head.apply()
    k, batch, hidden, vocab = 5, 3, 8, 50
    weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0))
    rows_seen = []

    def compute_logits(h):
        rows_seen.append(h.shape[0])
        return h @ weight.T

    fake = SimpleNamespace(
        num_speculative_tokens=k, use_local_argmax_reduction=False,
        model=SimpleNamespace(compute_logits=compute_logits),
    )  # fmt: skip
    states = torch.randn(batch * k, hidden, generator=torch.Generator().manual_seed(1))
    full = (states @ weight.T).argmax(-1).view(batch, k)
    assert DFlashProposer._greedy_sample(fake, states).equal(full.view(-1))  # no key
    assert partial_draft_head.head_positions(fake) == k
    for d in (1, 2, 4):
        setattr(fake, context_only_pass.NEXT_DRAFTS_ATTR, d)
        ids = DFlashProposer._greedy_sample(fake, states).view(batch, k)
        assert ids[:, :d].equal(full[:, :d]) and not ids[:, d:].any()
        assert rows_seen[-1] == batch * d
        assert partial_draft_head.head_positions(fake) == d
    setattr(fake, context_only_pass.NEXT_DRAFTS_ATTR, k)  # all verified: vLLM's head
    assert DFlashProposer._greedy_sample(fake, states).equal(full.view(-1))
    assert rows_seen[-1] == batch * k and partial_draft_head.head_positions(fake) == k


# -- short draft block --------------------------------------------------------------
def test_short_draft_block_runs_vllms_block_of_d(isolated, monkeypatch):
    """0 < d < k: vLLM's propose runs as for num_speculative_tokens = d (a query
    block of 1 + d), padded back to k with zeros; k, 0 and no key: unchanged."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    isolated(short_draft_block.PATCH)
    blocks = []

    def stock(self, **kw):
        blocks.append(self.num_speculative_tokens)
        if kw.get("fail"):
            raise RuntimeError("drafter failed")
        return torch.arange(1, 2 * self.num_speculative_tokens + 1).view(2, -1)

    monkeypatch.setattr(DFlashProposer, "propose", stock)
    short_draft_block.apply()
    k = 5

    def groups(*names):
        return [
            SimpleNamespace(backend=SimpleNamespace(get_name=lambda n=n: n))
            for n in names
        ]

    fake = SimpleNamespace(
        num_speculative_tokens=k, draft_attn_groups=groups("FLASH_ATTN")
    )
    out = DFlashProposer.propose(fake, common_attn_metadata=None)  # no key
    assert blocks == [k] and out.equal(torch.arange(1, 11).view(2, k))
    assert short_draft_block.query_block(fake) == k
    for d in (1, 3):
        setattr(fake, context_only_pass.NEXT_DRAFTS_ATTR, d)
        out = DFlashProposer.propose(fake, common_attn_metadata=None)
        assert blocks[-1] == d and fake.num_speculative_tokens == k
        assert out.shape == (2, k) and not out[:, d:].any()
        assert out[:, :d].equal(torch.arange(1, 2 * d + 1).view(2, d))
        assert short_draft_block.query_block(fake) == d
        assert partial_draft_head.head_positions(fake) == d
    for d in (0, k):  # a context-only pass (inside stock) and a full block
        setattr(fake, context_only_pass.NEXT_DRAFTS_ATTR, d)
        DFlashProposer.propose(fake, common_attn_metadata=None)
        assert blocks[-1] == k and short_draft_block.query_block(fake) == k
    setattr(fake, context_only_pass.NEXT_DRAFTS_ATTR, 2)
    with pytest.raises(RuntimeError, match="drafter failed"):
        DFlashProposer.propose(fake, common_attn_metadata=None, fail=True)
    assert fake.num_speculative_tokens == k  # restored on error

    # a backend without short blocks (FLEX_ATTENTION recompiled per block length
    # on the H200) drafts the full block
    flex = SimpleNamespace(
        num_speculative_tokens=k,
        draft_attn_groups=groups("FLASH_ATTN", "FLEX_ATTENTION"),
    )
    setattr(flex, context_only_pass.NEXT_DRAFTS_ATTR, 2)
    DFlashProposer.propose(flex, common_attn_metadata=None)
    assert blocks[-1] == k and short_draft_block.query_block(flex) == k


def test_the_top_bucket_is_capped_at_max_num_seqs():
    """Bucket 7 holds batches of 64-127 requests; with max_num_seqs 64 its largest
    batch is 64, so k = 7 runs as a full graph there (64 x 8 = 512 tokens)."""
    capped = DraftLengthPolicy(7, full_graph_tokens=512, max_num_reqs=64)
    uncapped = DraftLengthPolicy(7, full_graph_tokens=512)
    assert capped._bucket(7).graph_k
    assert not uncapped._bucket(7).graph_k  # 127 x 8 > 512
