# SPDX-License-Identifier: Apache-2.0
"""The patch registry: declarations, off switch, probes, idempotency, loud failure."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from packaging.specifiers import SpecifierSet

from vllm_dflash.patches import aux_layers, registry
from vllm_dflash.patches.catalog import PATCHES
from vllm_dflash.patches.registry import Patch, PatchError, PatchState, evaluate


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
    """Never shift twice: a vLLM that already adds 1 makes the probe say no."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock = registry.original(GPUModelRunner._get_eagle3_aux_layers_from_config)
    assert stock(aux_layers._fake_runner([0, 2])) == (0, 2)  # 0.20.1: unshifted
    assert aux_layers.probe() is True

    def upstream_fixed(self):
        ids = stock(self)
        return tuple(i + 1 for i in ids)

    monkeypatch.setattr(
        GPUModelRunner, "_get_eagle3_aux_layers_from_config", upstream_fixed
    )
    assert aux_layers.probe() is False


def test_aux_shift_only_for_dflash():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

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
        [sys.executable, "-m", "vllm_dflash.cli", "doctor", "--json"],
        env={**os.environ, **env}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return {p["name"]: p for p in json.loads(out.stdout)["patches"]}


def test_doctor_reports_states_on_this_vllm():
    states = _doctor_json(
        {"VLLM_DFLASH_DISABLE": "dflash_sliding_window", "VLLM_DFLASH_TRACE": ""}
    )
    assert states["dflash_sliding_window"]["state"] == "disabled"
    assert states["dflash_aux_layer_shift"]["state"] == "applied"
    assert states["dflash_trace"]["state"] == "not applicable"
    from vllm_dflash.cpu.weights import repacking_active

    want = "applied" if repacking_active() else "not needed"
    assert states["cpu_keep_dflash_weights"]["state"] == want
    for name in (
        "cpu_aux_hidden_state_layers",
        "cpu_cli_distribution_name",
        "cli_speculative_config",
        "cli_speculative_config_shell_split",
        "dflash_config_validation",
        "cpu_rejection_sampler_args",
        "cpu_dflash_input_expansion",
        "cpu_attn_kv_cache_update",
        "cpu_attn_exact_noncausal",
    ):
        assert states[name]["state"] == "applied", states[name]


def test_unsupported_vllm_version_applies_nothing(monkeypatch, caplog):
    from packaging.version import Version

    monkeypatch.setattr(registry, "_results", {})
    monkeypatch.setattr(registry, "_applied_pid", None)
    monkeypatch.setattr(registry, "is_supported_vllm", lambda: False)
    monkeypatch.setattr(registry, "vllm_version", lambda: Version("0.19.0"))
    res = registry.apply_all()
    assert {r.state for r in res.values()} == {PatchState.NOT_APPLICABLE}
