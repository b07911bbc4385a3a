# SPDX-License-Identifier: Apache-2.0
"""The real ``vllm`` CLI and ``vllm.LLM`` with the plugin: flag, parsing, validation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.bad_drafters import CASES, make

pytestmark = pytest.mark.cpu_e2e
ROOT = Path(__file__).resolve().parents[2]
VLLM = [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


def test_plain_serve_help_lists_speculative_config():
    out = subprocess.run(
        [*VLLM, "serve", "--help"], env=_env(), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if "spec" in ln.lower()]
    assert any("--speculative-config" in ln and "dflash" in ln for ln in lines), (
        out.stdout
    )


def test_unparseable_value_is_one_clear_line(tiny_models):
    bad = "{method:dflash,model}"
    out = subprocess.run(
        [*VLLM, "serve", str(tiny_models.target), "--speculative-config", bad],
        env=_env(), capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    err = [ln for ln in out.stderr.splitlines() if "--speculative-config" in ln]
    assert len(err) == 1 and repr(bad) in err[0] and "quotes" in err[0], out.stderr[
        -2000:
    ]


def test_bad_drafter_via_serve_fails_before_loading(tiny_models, tmp_path):
    drafter = make(
        tiny_models.dense, tmp_path / "bad", {"dflash_config.mask_token_id": 512}
    )
    spec = (
        f"{{method:dflash,model:{drafter},num_speculative_tokens:4}}"  # quotes stripped
    )
    out = subprocess.run(
        [*VLLM, "serve", str(tiny_models.target), "--dtype", "float32", "--speculative-config", spec],
        env=_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert (
        "vllm serve: error: drafter config dflash_config.mask_token_id=512"
        in out.stderr
    )
    assert "Loading weights" not in out.stdout + out.stderr


@pytest.fixture(scope="module")
def llm_errors(tiny_models, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("bad-drafters")
    out = subprocess.run(
        [sys.executable, "-m", "tests.helpers.validate_cases", str(tiny_models.target), str(tiny_models.dense), str(work)],
        env=_env(), capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert line, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(line[0][len("RESULTS ") :])


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_drafter_config_one_line_error(llm_errors, case):
    got = llm_errors[case]
    assert got["error"] is not None, f"{case}: accepted"
    assert got["type"] == "DrafterConfigError", got
    assert CASES[case][2] in got["error"], got["error"]
    assert "\n" not in got["error"]


def test_vllm_command_runs_on_the_cpu_wheel():
    """cpu_cli_distribution_name: the `vllm` CLI finds its version and the CPU platform."""
    from vllm_dflash.cpu.dist_name import probe

    if not probe():
        pytest.skip("a 'vllm' distribution is installed: nothing to fix")
    ok = subprocess.run(
        [*VLLM, "--version"], env=_env(), capture_output=True, text=True
    )
    assert ok.returncode == 0 and ok.stdout.strip().endswith("+cpu"), ok.stderr[-2000:]
    env = {**_env(), "VLLM_DFLASH_DISABLE": "cpu_cli_distribution_name"}
    bad = subprocess.run([*VLLM, "--version"], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "PackageNotFoundError" in bad.stderr
