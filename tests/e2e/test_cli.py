# SPDX-License-Identifier: Apache-2.0
"""The real ``vllm`` CLI and ``vllm.LLM`` with the plugin: flag, parsing, validation."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.bad_drafters import CASES, make
from tests.helpers.validate_cases import ENGINE_CASES, SPEC_CASES

pytestmark = pytest.mark.cpu_e2e
ROOT = Path(__file__).resolve().parents[2]
VLLM = [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


class CliRuns:
    """The module's CLI commands, started together (at most ``WORKERS`` at once):
    each is a Python start-up and a vLLM import, single-threaded, so two overlap
    on a 2-core CI machine. ``result(name)`` waits for one."""

    WORKERS = 3

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(self.WORKERS)
        self._futures: dict[str, Future] = {}

    def start(self, name: str, argv: list[str], **kw) -> None:
        kw = {"env": _env(), "capture_output": True, "text": True, "timeout": 900, **kw}
        self._futures[name] = self._pool.submit(subprocess.run, argv, **kw)

    def result(self, name: str) -> subprocess.CompletedProcess:
        return self._futures[name].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


BAD_SPEC = "{method:dflash,model}"


@pytest.fixture(scope="module")
def cli(tiny_models, tmp_path_factory):
    runs = CliRuns()
    runs.start("help", [*VLLM, "serve", "--help"])
    runs.start(
        "unparseable",
        [*VLLM, "serve", str(tiny_models.target), "--speculative-config", BAD_SPEC],
    )
    drafter = make(
        tiny_models.dense,
        tmp_path_factory.mktemp("bad-serve") / "bad",
        {"dflash_config.mask_token_id": 512},
    )
    spec = (
        f"{{method:dflash,model:{drafter},num_speculative_tokens:4}}"  # quotes stripped
    )
    runs.start(
        "bad_drafter",
        [*VLLM, "serve", str(tiny_models.target), "--dtype", "float32",
         "--speculative-config", spec],
    )  # fmt: skip
    runs.start("version", [*VLLM, "--version"])
    runs.start(
        "version_stock",
        [*VLLM, "--version"],
        env={**_env(), "VLLM_DFLASH_DISABLE": "cpu_cli_distribution_name"},
    )
    work = tmp_path_factory.mktemp("bad-drafters")
    runs.start(
        "validate_cases",
        [sys.executable, "-m", "tests.helpers.validate_cases",
         str(tiny_models.target), str(tiny_models.dense), str(work)],
        cwd=ROOT,
    )  # fmt: skip
    yield runs
    runs.close()


def test_plain_serve_help_lists_speculative_config(cli):
    out = cli.result("help")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if "spec" in ln.lower()]
    assert any("--speculative-config" in ln and "dflash" in ln for ln in lines), (
        out.stdout
    )


def test_unparseable_value_is_one_clear_line(cli):
    bad = BAD_SPEC
    out = cli.result("unparseable")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    err = [ln for ln in out.stderr.splitlines() if "--speculative-config" in ln]
    assert len(err) == 1 and repr(bad) in err[0] and "quotes" in err[0], out.stderr[
        -2000:
    ]


def test_bad_drafter_via_serve_fails_before_loading(cli):
    out = cli.result("bad_drafter")
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert (
        "vllm serve: error: drafter config dflash_config.mask_token_id=512"
        in out.stderr
    )
    assert "Loading weights" not in out.stdout + out.stderr


@pytest.fixture(scope="module")
def llm_errors(cli) -> dict:
    out = cli.result("validate_cases")
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


@pytest.mark.parametrize("case", sorted(SPEC_CASES))
def test_bad_speculative_config_key_one_line_error(llm_errors, case):
    got = llm_errors[case]
    assert got["error"] is not None, f"{case}: accepted"
    assert got["type"] == "DrafterConfigError", got
    assert SPEC_CASES[case][1] in got["error"], got["error"]
    assert "\n" not in got["error"]


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_engine_args_one_line_error(llm_errors, case):
    """dflash_full_step_budget: a budget vLLM would refuse with a multi-line
    pydantic error (a negative step budget) is one line naming the fix."""
    got = llm_errors[case]
    assert got["error"] is not None, f"{case}: accepted"
    assert got["type"] == "StepBudgetError", got
    assert ENGINE_CASES[case][1] in got["error"], got["error"]
    assert "--max-num-batched-tokens to 256" in got["error"], got["error"]
    assert "\n" not in got["error"]


def test_vllm_command_runs_on_the_cpu_wheel(cli):
    """cpu_cli_distribution_name: the `vllm` CLI finds its version and the CPU platform."""
    from vllm_dflash.cpu.dist_name import probe

    if not probe():
        pytest.skip("a 'vllm' distribution is installed: nothing to fix")
    ok = cli.result("version")
    assert ok.returncode == 0 and ok.stdout.strip().endswith("+cpu"), ok.stderr[-2000:]
    bad = cli.result("version_stock")
    assert bad.returncode != 0 and "PackageNotFoundError" in bad.stderr


def test_shell_split_config_in_other_entry_points():
    """cli_speculative_config_shell_split in `python -m ...api_server` (word-split JSON)
    and `vllm bench` (brace-expanded JSON), each started through bash as typed.
    `vllm serve` is covered by tests/e2e/test_server.py. The model does not exist:
    each command stops right after vLLM has parsed argv."""
    py = shlex.quote(sys.executable)
    lines = {
        "api_server": f"exec {py} -m vllm.entrypoints.openai.api_server "
        "--model /nonexistent/target --port 1 "
        '--speculative-config {"method": "dflash", "model": "/d", "num_speculative_tokens": 4}',
        "bench": f"exec {py} -m vllm.entrypoints.cli.main bench latency "
        '--model /nonexistent/target -sc {"method":"dflash","model":"/d","num_speculative_tokens":4} '
        "--num-iters 1",
    }
    env = {**_env(), "HF_HUB_OFFLINE": "1"}
    procs = {
        name: subprocess.Popen(
            ["bash", "-c", line],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for name, line in lines.items()
    }
    want = (
        'rebuilt it as {"method": "dflash", "model": "/d", "num_speculative_tokens": 4}'
    )
    outs = {name: proc.communicate(timeout=600)[0] for name, proc in procs.items()}
    for name, out in outs.items():
        assert procs[name].returncode != 2, f"{name}: argv rejected\n{out[-3000:]}"
        assert "arrived taken apart by a shell" in out and want in out, out[-3000:]
    # vLLM's own echo of the parsed arguments.
    assert (
        "'speculative_config': {'method': 'dflash', 'model': '/d'" in outs["api_server"]
    )
