# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import itertools
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.engine_log import run_engine_process
from vllm_dflash.testing.tiny_models import TinyModels, ensure_tiny_models

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = ROOT / "tests" / "helpers" / "offline_run.py"


def pytest_configure(config) -> None:
    # Subprocesses (vLLM engines, servers, the CLI) import this checkout's
    # vllm_dflash and tests.helpers, never a stale installed copy.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )


def needed_here(patch_name: str) -> tuple[bool, str]:
    """Whether the running vLLM needs the patch, and why not if it does not."""
    from vllm_dflash.catalog import PATCHES
    from vllm_dflash.registry import evaluate

    patch = next(p for p in PATCHES if p.name == patch_name)
    result = evaluate(patch, apply=False)
    return (
        result.state.value == "applied",
        f"{result.state.value} here ({result.reason})",
    )


def skip_unless_needed(patch_name: str) -> None:
    """Skip a "this patch matters" test where the running vLLM does not need it
    (fixed upstream, or the defect is absent on this CPU)."""
    needed, why = needed_here(patch_name)
    if not needed:
        pytest.skip(f"{patch_name}: {why}")


def _resolve(target: str) -> tuple[object, str]:
    """``"module:Qual.name"`` -> (owner object, attribute name)."""
    import importlib

    module, qual = target.split(":")
    owner: object = importlib.import_module(module)
    *path, attr = qual.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


def restore_after(mp: pytest.MonkeyPatch, patch) -> None:
    """Register ``patch``'s vLLM targets with ``mp`` so that undoing ``mp``
    restores them: unit tests that call a patch's ``apply()`` must not leave
    vLLM classes patched for the tests after them."""
    import collections.abc

    for target in patch.targets:
        owner, attr = _resolve(target)
        if isinstance(owner, collections.abc.MutableMapping):
            if attr in owner:
                mp.setitem(owner, attr, owner[attr])
            else:
                mp.delitem(owner, attr, raising=False)
        elif isinstance(owner, type) and attr in owner.__dict__:
            mp.setattr(owner, attr, owner.__dict__[attr])  # staticmethods stay wrapped
        elif hasattr(owner, attr):
            mp.setattr(owner, attr, getattr(owner, attr))
        else:  # a patch that adds the attribute: undo deletes it again
            mp.setattr(owner, attr, None, raising=False)
            mp.delattr(owner, attr)


@pytest.fixture
def isolated(monkeypatch):
    """``isolated(patch)``: the patch's vLLM targets are restored after the test."""
    return lambda patch: restore_after(monkeypatch, patch)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    cache = os.environ.get("VLLM_DFLASH_FIXTURES")
    return ensure_tiny_models(
        Path(cache) if cache else tmp_path_factory.mktemp("fixtures")
    )


@dataclass
class RunResult:
    returncode: int
    data: dict | None
    trace: list[dict]
    log: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.data is not None


class OfflineRunner:
    """Runs tests/helpers/offline_run.py in a subprocess, memoised per config."""

    def __init__(self, workdir: Path, models: TinyModels) -> None:
        self.workdir = workdir
        self.models = models
        self._cache: dict[tuple, RunResult] = {}
        self._tags = itertools.count()

    def run(
        self,
        drafter: str | Path | None,
        disable: tuple[str, ...] = (),
        prefix_caching: bool = False,
        max_num_batched_tokens: int | None = None,
        k: int = 4,
        pythonpath: str | None = None,
        timeout: float = 900,
        tp: int = 1,
        target: Path | None = None,
        prompts: tuple[tuple[int, ...], ...] | None = None,
        max_tokens: int | None = None,
        extra_args: tuple[str, ...] = (),
        prompt_set: str = "mixed",
        env: tuple[tuple[str, str], ...] = (),
    ) -> RunResult:
        """One engine process per distinct configuration (memoised).

        ``drafter``: a name of the tiny fixtures ("dense", "swa") or a checkpoint
        path; ``target`` defaults to the tiny target; ``prompts`` to the
        helper's deterministic mix."""
        key = (
            prompt_set,
            drafter,
            disable,
            prefix_caching,
            max_num_batched_tokens,
            k,
            pythonpath,
            tp,
            target,
            prompts,
            max_tokens,
            extra_args,
            env,
        )
        if key in self._cache:
            return self._cache[key]
        tag = f"run{next(self._tags)}"
        out = self.workdir / f"{tag}.json"
        trace = self.workdir / f"{tag}.jsonl"
        cmd = [
            sys.executable,
            str(OFFLINE),
            "--target",
            str(target or self.models.target),
            "--out",
            str(out),
            "--k",
            str(k),
        ]
        if drafter:
            path = (
                drafter if isinstance(drafter, Path) else getattr(self.models, drafter)
            )
            cmd += ["--drafter", str(path)]
        if prompts is not None:
            prompts_file = self.workdir / f"{tag}.prompts.json"
            prompts_file.write_text(json.dumps([list(p) for p in prompts]))
            cmd += ["--prompts", str(prompts_file)]
        if max_tokens is not None:
            cmd += ["--max-tokens", str(max_tokens)]
        if prefix_caching:
            cmd.append("--prefix-caching")
        cmd += list(extra_args)
        if prompt_set != "mixed":
            cmd += ["--prompt-set", prompt_set]
        if max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        extra_env = env
        env = {
            **os.environ,
            # The engine core runs in this process: one Python start-up fewer
            # per run (the CPU worker is still its own process).
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_DFLASH_TRACE": str(trace),
            # A test's own list, plus any from the caller's environment (to watch
            # the equivalence tests go red with a backport disabled).
            "VLLM_DFLASH_DISABLE": ",".join(
                [
                    *disable,
                    *filter(None, os.environ.get("VLLM_DFLASH_DISABLE", "").split(",")),
                ]
            ),
        }
        env.update(dict(extra_env))
        if tp > 1:
            cmd += ["--tp", str(tp)]
            # One core per CPU worker (vLLM-CPU cannot auto-bind TP ranks on one
            # NUMA node): "0|1" style lists from the cores this process may use.
            cores = sorted(os.sched_getaffinity(0))[:tp]
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in cores)
        paths = [pythonpath] if pythonpath else []
        env["PYTHONPATH"] = os.pathsep.join(
            [*paths, str(ROOT), env.get("PYTHONPATH", "")]
        )
        # a worker that died silently (a machine fault) or a rendezvous port that
        # another process took is run once more
        rc, log = run_engine_process(cmd, env, timeout)
        (self.workdir / f"{tag}.log").write_text(log)
        data = json.loads(out.read_text()) if rc == 0 and out.exists() else None
        records = (
            [json.loads(x) for x in trace.read_text().splitlines()]
            if trace.exists()
            else []
        )
        res = RunResult(rc, data, records, log)
        self._cache[key] = res
        return res

    def run_many(self, configs: list[dict], jobs: int = 2) -> list[RunResult]:
        """``run(**config)`` for each config, ``jobs`` engine processes at a time
        (engine start-up is mostly single-threaded Python: two overlap well on
        two cores). Results in the order of ``configs``."""
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(lambda kw: self.run(**kw), configs))


@pytest.fixture(scope="session")
def offline(tmp_path_factory, tiny_models) -> OfflineRunner:
    return OfflineRunner(tmp_path_factory.mktemp("offline"), tiny_models)
