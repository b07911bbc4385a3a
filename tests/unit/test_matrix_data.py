# SPDX-License-Identifier: Apache-2.0
"""ci/matrix.toml is complete and the generated workflow matches it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ci.matrix import expected_states, load_matrix
from vllm_dflash.catalog import PATCHES
from vllm_dflash.compat import SUPPORTED_VLLM as SUPPORTED

ROOT = Path(__file__).resolve().parents[2]
STATES = {"applied", "not needed", "not applicable", "disabled"}


def test_every_version_has_a_state_for_every_patch():
    matrix = load_matrix()
    assert matrix["primary"] in matrix["versions"]
    names = {p.name for p in PATCHES}
    for version in matrix["versions"]:
        want = expected_states(matrix, version)
        assert set(want) == names, (version, set(want) ^ names)
        for name, allowed in want.items():
            assert set(allowed) <= STATES, (version, name, allowed)


def test_matrix_versions_are_inside_the_supported_range():
    from packaging.version import Version

    for version in load_matrix()["versions"]:
        assert Version(version) in SUPPORTED, version


def test_upstream_fixes_expected_not_needed_where_released():
    """Facts from shared/docs: #40727 is upstream from 0.22.0, the CPU
    rejection-sampler fix from 0.21.0, #40898 in none of these releases."""
    from packaging.version import Version

    matrix = load_matrix()
    for version in matrix["versions"]:
        want = expected_states(matrix, version)
        v = Version(version)
        shift = "not needed" if v >= Version("0.22.0") else "applied"
        assert want["dflash_aux_layer_shift"] == [shift], version
        rej = "not needed" if v >= Version("0.21.0") else "applied"
        assert want["cpu_rejection_sampler_args"] == [rej], version
        assert want["dflash_sliding_window"] == ["applied"], version


def test_github_workflow_is_generated_from_the_matrix():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "ci" / "gen_workflow.py"), "--check"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_plugin_verified_list_equals_the_matrix():
    from vllm_dflash.compat import VERIFIED_VLLM

    assert list(VERIFIED_VLLM) == list(load_matrix()["versions"])
