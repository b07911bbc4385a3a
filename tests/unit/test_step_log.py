# SPDX-License-Identifier: Apache-2.0
"""VLLM_DFLASH_STEP_LOG (core/step_log.py): one line per engine step, and the
per-batch summary benchmarks/gpu/perf_synthetic.py makes of it."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from benchmarks.gpu.perf_synthetic import step_summary
from vllm_dflash.core.step_log import StepLog


def _out(tokens: dict[str, int], spec: dict[str, list[int]], new: int = 0):
    return SimpleNamespace(
        num_scheduled_tokens=tokens,
        total_num_scheduled_tokens=sum(tokens.values()),
        scheduled_spec_decode_tokens=spec,
        scheduled_new_reqs=[object()] * new,
    )


def test_each_step_is_one_line_paired_with_its_own_output(tmp_path):
    path = tmp_path / "steps.jsonl"
    log = StepLog(str(path))
    mixed = _out({"a": 40, "b": 3}, {"b": [7, 7]}, new=1)  # a prefill chunk
    decode = _out({"a": 4, "b": 4}, {"a": [1, 2, 3], "b": [4, 5, 6]})
    zero = _out({"a": 1, "b": 1}, {"a": [], "b": []})  # 0 drafts, still spec
    log.scheduled(mixed)
    log.scheduled(decode)  # asynchronous scheduling: scheduled before
    log.output(mixed)  # the output of the step before it
    time.sleep(0.02)
    log.output(decode)
    log.scheduled(zero)
    log.output(zero)
    log.output(_out({"c": 1}, {}))  # never scheduled here: no line
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["reqs"], r["tokens"], r["drafts"], r["dmax"]) for r in lines] == [
        (2, 43, 2, 2),
        (2, 8, 6, 3),
        (2, 2, 0, 0),
    ]
    assert [r["decode"] for r in lines] == [False, True, True]
    assert [r["new"] for r in lines] == [1, 0, 0]
    # a step's time starts at the previous output, not at its own (earlier)
    # scheduling: the second step took the 20 ms between the two outputs
    assert 15 <= lines[1]["ms"] < 200, lines[1]
    assert lines[0]["t"] <= lines[1]["t"] <= lines[2]["t"]


def test_summary_per_batch_and_draft_length(tmp_path):
    path = tmp_path / "steps.jsonl"
    recs = [
        dict(t=1.0, ms=99.0, reqs=4, tokens=4, drafts=0, dmax=0, new=0, decode=True),
        dict(t=2.0, ms=50.0, reqs=4, tokens=900, drafts=0, dmax=0, new=2, decode=False),
        dict(t=2.1, ms=10.0, reqs=4, tokens=4, drafts=0, dmax=0, new=0, decode=True),
        dict(t=2.2, ms=12.0, reqs=4, tokens=4, drafts=0, dmax=0, new=0, decode=True),
        dict(t=2.3, ms=30.0, reqs=4, tokens=16, drafts=12, dmax=3, new=0, decode=True),
        dict(t=2.4, ms=20.0, reqs=4, tokens=14, drafts=10, dmax=3, new=0, decode=True),
        dict(t=9.0, ms=77.0, reqs=4, tokens=4, drafts=0, dmax=0, new=0, decode=True),
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert step_summary(str(path), 1.5, 3.0) == {
        "decode": {
            "0": {"steps": 2, "median_ms": 11.0, "max_ms": 12.0, "ms": 22.0},
            "3": {"steps": 1, "median_ms": 30.0, "max_ms": 30.0, "ms": 30.0},
            # requests verified 3, 3, 3, 1
            "x": {"steps": 1, "median_ms": 20.0, "max_ms": 20.0, "ms": 20.0},
        },
        "mixed": {"steps": 1, "ms": 50.0},
        "slowest": [[50.0, "mixed", 4], [30.0, "3", 4], [20.0, "x", 4]],
    }
    assert step_summary(str(tmp_path / "absent.jsonl"), 0, 10) == {}


def test_step_clock_measures_between_outputs():
    """core/step_clock.py: the first step counts from its scheduling and is not
    after an output; a step scheduled before the previous output (asynchronous
    scheduling) counts from that output."""
    from vllm_dflash.core.step_clock import StepClock

    clock: StepClock[str] = StepClock()
    a, b = object(), object()
    clock.scheduled(a, "a")
    clock.scheduled(b, "b")
    time.sleep(0.05)
    first = clock.output(a)
    time.sleep(0.05)
    second = clock.output(b)
    assert first is not None and second is not None
    assert (first.payload, first.after_output) == ("a", False)
    assert first.seconds >= 0.05
    assert (second.payload, second.after_output) == ("b", True)
    assert 0.04 <= second.seconds < 0.09  # from a's output, not b's scheduling
    assert clock.output(object()) is None


def test_adaptive_controller_times_decode_steps_with_the_clock():
    """The adaptive controller feeds its policy the step clock's time of
    measurable steps only (decode-only, same length and bucket as the step
    before, after an output)."""
    from vllm_dflash.core.adaptive_draft_length import DraftLengthController
    from vllm_dflash.core.draft_length_policy import DraftLengthPolicy

    reqs = [SimpleNamespace(request_id=r, spec_token_ids=[9] * 4) for r in "ab"]
    sched = SimpleNamespace(running=reqs)
    policy = DraftLengthPolicy(4)
    seen: list[tuple[int, int, float]] = []
    policy.observe_step = lambda n, d, dt: seen.append((n, d, dt))  # type: ignore[method-assign]
    ctl = DraftLengthController(sched, 4, forced=(2,), policy=policy)

    def stock():
        return _out({"a": 3, "b": 3}, {"a": [9, 9], "b": [9, 9]})

    outs = [ctl.schedule(stock) for _ in range(3)]
    for out in outs:
        time.sleep(0.05)
        ctl.observe(out, SimpleNamespace())
    # the first step has no step before it: not measurable; the others are, and
    # each counts from the output before it (~50 ms), not from its own
    # scheduling, which came before every output (>= 100 ms)
    assert [(n, d) for n, d, _ in seen] == [(2, 2), (2, 2)]
    assert all(0.04 <= dt < 0.09 for _, _, dt in seen), seen
