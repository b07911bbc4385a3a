# SPDX-License-Identifier: Apache-2.0
"""Matrix smoke for whichever vLLM runs these tests (ci/matrix.py runs it per
version): the plugin loads, ``vllm-dflash doctor --json`` reports exactly the
states ci/matrix.toml expects, and one DFlash run is lossless (its output is the
float64 target's greedy continuation) with drafts equal to the float64 reference
(so a fix already upstream is not applied twice)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ci.matrix import expected_states, load_matrix
from tests.helpers.equivalence import compare, greedy_divergences
from tests.helpers.reference import Reference

pytestmark = pytest.mark.cpu_e2e


@pytest.fixture(scope="module")
def doctor() -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_dflash.entrypoints.cli.main", "doctor", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_doctor_states_match_matrix(doctor):
    matrix = load_matrix()
    version = doctor["vllm"].split("+")[0]
    assert version in matrix["versions"], (
        f"vLLM {version} is not in ci/matrix.toml; add it with its expected states"
    )
    want = expected_states(matrix, version)
    got = {p["name"]: p["state"] for p in doctor["patches"]}
    assert set(got) == set(want), (
        f"patches without an expected state for {version}: {set(got) ^ set(want)}"
    )
    wrong = {
        name: (got[name], want[name]) for name in got if got[name] not in want[name]
    }
    assert not wrong, f"vLLM {version}: (doctor state, expected) = {wrong}"


def test_dense_lossless_and_reference_equal(offline, tiny_models):
    """One DFlash run: its greedy output is the float64 target's own greedy
    continuation (lossless without a second engine start; near-ties below 1% of
    the logit range excused) and its drafts equal the float64 reference."""
    import os

    import vllm

    spec = load_matrix()["versions"].get(vllm.__version__.split("+")[0], {})
    if os.environ.get("VLLM_DFLASH_MATRIX_MODE") == "smoke" and not spec.get(
        "engine_smoke", True
    ):
        pytest.skip("ci/matrix.toml: no engine in this version's smoke (matrix-full)")
    # test_offline.py's chunked dense run (one engine for both in `make test`)
    run = offline.run("dense", max_num_batched_tokens=40)
    assert run.ok, run.log[-4000:]
    ref = Reference.load(tiny_models.target, tiny_models.dense)
    div = greedy_divergences(ref, run.data["prompts"], run.data["outputs"])
    assert all(d["gap_rel_range"] < 0.01 for d in div), div
    stats = compare(ref, run.data, run.trace)
    assert stats.drafts >= 200, stats
    assert stats.token_rate >= 0.99, stats
