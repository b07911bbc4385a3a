# SPDX-License-Identifier: Apache-2.0
"""The patch registry: declarations, off switch, probes, idempotency, loud failure."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from packaging.specifiers import SpecifierSet

from vllm_dflash import registry
from vllm_dflash.catalog import PATCHES
from vllm_dflash.registry import Patch, PatchError, PatchState, evaluate
from vllm_dflash.spec_decode import aux_layers


def test_every_patch_is_fully_declared():
    names = [p.name for p in PATCHES]
    assert len(names) == len(set(names))
    for p in PATCHES:
        assert p.targets and all(":" in t and t.startswith("vllm.") for t in p.targets)
        assert p.summary and p.why and p.upstream and p.future
        SpecifierSet(p.versions)  # parses
        assert p.platforms and callable(p.probe) and callable(p.apply)


def _fake(probe=lambda: True, apply=lambda: None, **kw) -> Patch:
    base = dict(
        name="fake_patch", targets=("vllm.x:y",), summary="s", why="w", upstream="u",
        versions=">=0.1", platforms=("cpu", "cuda"), probe=probe, apply=apply, future="f",
    )  # fmt: skip
    base.update(kw)
    return Patch(**base)


def test_disable_switch(monkeypatch):
    monkeypatch.setenv("VLLM_DFLASH_DISABLE", "other, fake_patch")
    applied = []
    res = evaluate(_fake(apply=lambda: applied.append(1)), apply=True)
    assert res.state is PatchState.DISABLED and not applied


def test_version_and_platform_gates():
    assert (
        evaluate(_fake(versions="<0.1"), apply=True).state is PatchState.NOT_APPLICABLE
    )
    assert (
        evaluate(_fake(platforms=("tpu",)), apply=True).state
        is PatchState.NOT_APPLICABLE
    )


def test_probe_false_means_not_needed_and_not_applied():
    applied = []
    res = evaluate(
        _fake(probe=lambda: False, apply=lambda: applied.append(1)), apply=True
    )
    assert res.state is PatchState.NOT_NEEDED and not applied


def test_broken_probe_or_apply_fails_loudly():
    def boom():
        raise AttributeError("GPUModelRunner has no attribute 'x'")

    with pytest.raises(PatchError, match="fake_patch.*0\\.20"):
        evaluate(_fake(probe=boom), apply=True)
    with pytest.raises(PatchError, match="fake_patch.*VLLM_DFLASH_DISABLE=fake_patch"):
        evaluate(_fake(apply=boom), apply=True)


def test_replace_attr_is_idempotent_and_loud():
    class Owner:
        def f(self):
            return "stock"

    stock = Owner.f

    def f(self):
        return "patched"

    registry.replace_attr(Owner, "f", f, "p")
    registry.replace_attr(Owner, "f", f, "p")
    assert Owner().f() == "patched" and registry.original(Owner.f) is stock
    with pytest.raises(AttributeError):
        registry.replace_attr(Owner, "missing", f, "p")


def test_aux_shift_probe_reads_vllm_behaviour(monkeypatch):
    """Never shift twice: the probe says what the running vLLM does."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock = registry.original(GPUModelRunner._get_eagle3_aux_layers_from_config)
    shifted = stock(aux_layers._fake_runner([0, 2])) == (1, 2 + 1)
    assert aux_layers.probe() is (not shifted)

    def unshifted(self):
        return (0, 2)

    monkeypatch.setattr(GPUModelRunner, "_get_eagle3_aux_layers_from_config", unshifted)
    assert aux_layers.probe() is True

    def upstream_fixed(self):
        return (1, 3)

    monkeypatch.setattr(
        GPUModelRunner, "_get_eagle3_aux_layers_from_config", upstream_fixed
    )
    assert aux_layers.probe() is False


def test_aux_shift_only_for_dflash(isolated):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    isolated(aux_layers.PATCH)
    aux_layers.apply()
    patched = GPUModelRunner._get_eagle3_aux_layers_from_config
    assert patched(aux_layers._fake_runner([1, 9, 17])) == (2, 10, 18)
    eagle = SimpleNamespace(
        speculative_config=SimpleNamespace(
            method="eagle3",
            draft_model_config=SimpleNamespace(
                hf_config=SimpleNamespace(eagle_aux_hidden_state_layer_ids=[1, 9])
            ),
        )
    )
    assert patched(eagle) == (1, 9)


def _doctor_json(env: dict[str, str]) -> dict:
    import json
    import os

    out = subprocess.run(
        [sys.executable, "-m", "vllm_dflash.entrypoints.cli.main", "doctor", "--json"],
        env={**os.environ, **env}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return {p["name"]: p for p in json.loads(out.stdout)["patches"]}


def test_doctor_reports_states_on_this_vllm():
    """The states ci/matrix.toml expects for the running vLLM (any pinned one)."""
    from ci.matrix import expected_states, load_matrix
    from vllm_dflash.compat import vllm_version

    states = _doctor_json(
        {"VLLM_DFLASH_DISABLE": "dflash_sliding_window", "VLLM_DFLASH_TRACE": ""}
    )
    assert states["dflash_sliding_window"]["state"] == "disabled"
    want = expected_states(load_matrix(), str(vllm_version()))
    for name, allowed in want.items():
        if name != "dflash_sliding_window":
            assert states[name]["state"] in allowed, (name, states[name])


def test_failed_patch_does_not_stop_vllm_but_refuses_dflash(monkeypatch):
    """A patch that cannot apply is logged and recorded; vLLM starts, DFlash does
    not (raise_if_failed names the patch)."""

    def boom():
        raise AttributeError("moved upstream")

    monkeypatch.setattr(registry, "_results", {})
    monkeypatch.setattr(registry, "_applied_pid", None)
    monkeypatch.setattr(registry, "is_supported_vllm", lambda: True)
    res = registry.apply_all([_fake(apply=boom)], defer=False)
    assert res["fake_patch"].state is PatchState.FAILED
    with pytest.raises(PatchError, match="fake_patch.*moved upstream"):
        registry.raise_if_failed()


def test_unsupported_vllm_version_applies_nothing(monkeypatch, caplog):
    from packaging.version import Version

    monkeypatch.setattr(registry, "_results", {})
    monkeypatch.setattr(registry, "_applied_pid", None)
    monkeypatch.setattr(registry, "is_supported_vllm", lambda: False)
    monkeypatch.setattr(registry, "vllm_version", lambda: Version("0.19.0"))
    res = registry.apply_all(PATCHES)
    assert {r.state for r in res.values()} == {PatchState.NOT_APPLICABLE}


def test_applied_lines_wait_for_dflash(monkeypatch):
    """What a process applied is logged at INFO only once it runs DFlash: until
    then at DEBUG (an engine without DFlash logs what plain vLLM logs), then all
    at once, in order, without a forked parent's lines; later ones at once."""
    import logging
    import os

    seen: list[tuple[int, str]] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append((record.levelno, record.getMessage()))

    logger = registry._logger()
    handler = Capture(level=logging.DEBUG)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    monkeypatch.setattr(registry, "_results", {})
    monkeypatch.setattr(registry, "_applied_pid", None)
    monkeypatch.setattr(registry, "_dflash_in_use", False)
    monkeypatch.setattr(registry, "_pending", [(os.getpid() + 1, "a parent's line")])
    monkeypatch.setattr(registry, "is_supported_vllm", lambda: True)
    try:
        registry.apply_all([_fake(name="first"), _fake(name="second")], defer=False)
        assert not [m for lvl, m in seen if lvl >= logging.INFO]
        registry.note_dflash_in_use()
        info = [m for lvl, m in seen if lvl >= logging.INFO]
        assert len(info) == 1 and "applied first, second" in info[0], info
        registry.note_dflash_in_use()  # once
        registry._log_applied("on import of vllm.z, applied", ["first"], [])
        info = [m for lvl, m in seen if lvl >= logging.INFO]
        assert len(info) == 2 and "on import of vllm.z" in info[1], info
        assert not any("parent" in m for _, m in seen)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
