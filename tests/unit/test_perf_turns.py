# SPDX-License-Identifier: Apache-2.0
"""benchmarks/gpu/perf_synthetic.py ``--turn``: engines of two processes on one GPU
take turns batch by batch (the side-by-side harness for the 27B pair, issue #16).

Stand-in workers (no engine): no batch starts before every peer is ready, batches
alternate and never overlap, a peer that finished or was killed is passed, and an
earlier round's files do not count; a finished peer waits for the others.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

from benchmarks.gpu.perf_synthetic import Turns


def _peer(spec: str, mode: str, tag: str, log: str, start_delay: float, die_at: int):
    turns = Turns(spec, mode, tag)
    time.sleep(start_delay)  # a slower engine start
    with open(log, "a") as fh:
        fh.write(f"{time.monotonic():.6f} {mode} ready\n")
    turns.ready()
    for i in range(3):
        if i == die_at:
            os.kill(os.getpid(), signal.SIGKILL)  # a time limit's kill: no leave()

        def batch(i=i):
            with open(log, "a") as fh:
                fh.write(f"{time.monotonic():.6f} {mode} start {i}\n")
            time.sleep(0.05)
            with open(log, "a") as fh:
                fh.write(f"{time.monotonic():.6f} {mode} end {i}\n")

        turns.run(batch)
    turns.leave()
    turns.wait_all_left(30)
    with open(log, "a") as fh:
        fh.write(f"{time.monotonic():.6f} {mode} exit\n")


def _run(tmp_path, tag: str, delays: dict, die: dict) -> list[tuple[str, str, str]]:
    log = str(tmp_path / f"log-{tag}")
    spec = f"{tmp_path}/turns:base,plugin"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_peer, args=(spec, m, tag, log, delays.get(m, 0.0), die.get(m, -1))
        )
        for m in ("base", "plugin")
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode is not None, "a peer hung"
    with open(log) as fh:
        rows = [line.split(maxsplit=1) for line in fh.read().splitlines()]
    rows.sort(key=lambda r: float(r[0]))
    return [tuple(r[1].split()) for r in rows]


def test_batches_alternate_after_both_are_ready(tmp_path):
    events = _run(tmp_path, "rep1", {"base": 0.0, "plugin": 1.0}, {})
    first_batch = next(i for i, e in enumerate(events) if e[1] == "start")
    assert {e[0] for e in events[:first_batch] if e[1] == "ready"} == {"base", "plugin"}
    batches = [e for e in events if e[1] in ("start", "end")]
    # one at a time: every start is followed by its own end
    for a, b in zip(batches[::2], batches[1::2], strict=True):
        assert a[0] == b[0] and a[1:] == ("start", a[2]) and b[1] == "end"
    assert [e[0] for e in batches[::2]] == ["base", "plugin"] * 3
    # the peer that finished first exits only after the other's last batch (the
    # next round's engine start never overlaps a timed batch)
    assert [e[1] for e in events[-2:]] == ["exit", "exit"]


def test_a_killed_peer_is_passed_and_rounds_are_separate(tmp_path):
    _run(tmp_path, "rep1", {}, {})  # a finished round leaves its files behind
    events = _run(tmp_path, "rep2", {"base": 0.0, "plugin": 0.5}, {"base": 1})
    starts = [(e[0], e[2]) for e in events if e[1] == "start"]
    # rep2 waited for plugin's readiness despite rep1's files; then base died
    # before its second batch and plugin went on alone
    assert starts == [("base", "0"), ("plugin", "0"), ("plugin", "1"), ("plugin", "2")]


def test_turn_needs_a_fixed_kv_cache(tmp_path, capsys):
    """Two engines sizing their KV cache from a memory profile at the same time
    count each other's allocations: --turn without --kv-cache-gib is refused."""
    import pytest

    from benchmarks.gpu.perf_synthetic import main

    argv = ["adaptive", str(tmp_path / "p.jsonl"), "--root", str(tmp_path)]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--turn", f"{tmp_path}:base,adaptive"])
    assert exc.value.code == 2  # argparse's error: nothing started
    assert "--turn needs --kv-cache-gib" in capsys.readouterr().err
