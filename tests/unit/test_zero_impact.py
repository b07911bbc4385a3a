# SPDX-License-Identifier: Apache-2.0
"""Installing the plugin changes nothing for a vLLM user who does not run DFlash:
no warning at start-up, and the API server does not import the model runner
(worker-side patches wait for their module's import, in the worker)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from vllm_dflash import import_hooks

FRONTEND = textwrap.dedent(
    """
    import logging, sys
    import vllm.entrypoints.openai.api_server  # what `vllm serve` imports first
    from vllm.plugins import load_general_plugins
    load_general_plugins()  # vLLM loads vllm-dflash here
    from vllm_dflash import registry
    states = {n: r.state.value for n, r in registry._results.items()}
    print("RUNNER", "vllm.v1.worker.gpu_model_runner" in sys.modules)
    print("AUX", states["dflash_aux_layer_shift"])
    import vllm.v1.worker.gpu_model_runner as gmr  # what a worker does
    from vllm_dflash.registry import is_patched
    print("AFTER", registry._results["dflash_aux_layer_shift"].state.value,
          is_patched(gmr.GPUModelRunner._get_eagle3_aux_layers_from_config,
                     "dflash_aux_layer_shift"))
    """
)


PLAIN = textwrap.dedent(
    """
    import vllm.entrypoints.openai.api_server
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    import vllm.v1.worker.gpu_model_runner
    """
)


def _warnings(output: str) -> set[str]:
    """WARNING lines without their timestamp and source prefix (vLLM logs to
    stdout)."""
    return {
        line.split("] ", 1)[-1]
        for line in output.splitlines()
        if "WARNING" in line and "] " in line
    }


def test_frontend_does_not_import_the_model_runner():
    proc = subprocess.run(
        [sys.executable, "-c", FRONTEND], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert out["RUNNER"] == "False", "the plugin imported the model runner"
    assert out["AUX"] == "deferred"
    assert out["AFTER"] == "applied True"
    # No warning of vLLM's own that plain vLLM does not log either: a patch's
    # probe runs in every vLLM process and must not make vLLM warn (once
    # a probe's throwaway config logged "max_num_scheduled_tokens is set to 32").
    plain = subprocess.run(
        [sys.executable, "-c", PLAIN],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_PLUGINS": "__none__"},
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    extra = _warnings(proc.stdout + proc.stderr) - _warnings(
        plain.stdout + plain.stderr
    )
    assert not extra, extra
    # ...and no INFO line of the plugin's: a process that runs no DFlash logs
    # what it applied at DEBUG (tests/e2e/test_offline.py reads them at INFO from
    # a DFlash engine's processes).
    ours = [
        ln for ln in (proc.stdout + proc.stderr).splitlines() if "vllm-dflash" in ln
    ]
    assert not ours, ours
    assert "already registered" not in proc.stderr


def test_when_imported_runs_after_import_or_at_once(tmp_path, monkeypatch):
    (tmp_path / "late_module_for_hook_test.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []

    def callback() -> None:
        seen.append(sys.modules["late_module_for_hook_test"].VALUE + 1)

    assert import_hooks.when_imported("late_module_for_hook_test", callback) is False
    assert seen == []
    import late_module_for_hook_test  # noqa: F401

    assert seen == [42]
    assert import_hooks.when_imported("late_module_for_hook_test", callback) is True
    assert seen == [42, 42]
    monkeypatch.delitem(sys.modules, "late_module_for_hook_test")


WORKER = textwrap.dedent(
    """
    import sys
    from vllm_dflash import compat, registry
    if sys.argv[1] == "cuda":  # judge the CUDA patches (they patch Python only)
        registry.platform_name = lambda: "cuda"
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    import vllm.v1.worker.gpu_model_runner  # what a worker imports (it imports dflash)
    failed = [(r.name, r.reason[:300]) for r in registry.failed()]
    print("FAILED", failed)
    """
)


def test_deferred_patches_apply_on_import_in_a_worker():
    """Every patch applied on its module's import (as in a worker) applies
    cleanly, for the CUDA patches too (they patch Python only): a patch whose
    module is imported while another of its modules is still being imported
    would fail here (it did on the GPU: dflash_tp_graph_replay)."""
    for platform in ("cuda", "cpu"):
        proc = subprocess.run(
            [sys.executable, "-c", WORKER, platform],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "FAILED []" in proc.stdout, (platform, proc.stdout[-3000:])
