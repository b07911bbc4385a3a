# SPDX-License-Identifier: Apache-2.0
"""The GDN state replay's Triton kernels (the CUDA path) in Triton's interpreter.

``TRITON_INTERPRET=1`` runs ``@triton.jit`` kernels on the CPU (numpy, the same
pointer arithmetic, masks and loops). A subprocess
(``tests/helpers/replay_interpreted.py``) imports ``gdn_replay_triton`` with the
real ``triton`` (vLLM's CPU build hands out placeholders) and runs ``verify`` and ``commit`` against the torch path (the CPU
backend's, which ``tests/gpu/test_gdn_replay_kernels.py`` holds to vLLM's own
kernel on a GPU): outputs, stored one-token states, ring flags and pending
records, committed states (counts of 0, 1, all, more than the ring holds), null
slots untouched; q/k/v as strided views of a packed tensor and each value-block
width. This checks the kernels' indexing without a GPU; compilation
and timing need one (tests/gpu).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

HELPER = ROOT / "tests" / "helpers" / "replay_interpreted.py"


@pytest.fixture(scope="module")
def results() -> list[dict]:
    pytest.importorskip("triton")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(HELPER)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_interpreted_verify_equals_the_torch_path(results):
    for res in results:
        assert res["o"] <= 1e-5, res
        assert res["state"] <= 1e-6, res  # one-token verifies store the state
        assert res["flags"], res
        assert res["records"] == 0.0, res  # raw inputs, stored as they came


def test_interpreted_commit_equals_the_torch_path(results):
    for res in results:
        assert res["commit"] <= 1e-5, res


def test_interpreted_kernels_skip_null_and_unused_slots(results):
    assert all(res["untouched"] for res in results), results
