# SPDX-License-Identifier: Apache-2.0
"""benchmarks/gpu/gdn_backend.py: which GDN prefill kernel the GPU scripts ask vLLM
for (FlashInfer only where it can run without compiling, or can compile), what
vLLM's log says it used, and gpu_check's verdict on that."""

from __future__ import annotations

import copy
import importlib
import sys

import pytest

from benchmarks.gpu import gdn_backend as gb
from benchmarks.gpu.gpu_check import evaluate


def _fake_flashinfer(tmp_path, monkeypatch, aot: bool):
    pkg = tmp_path / "site" / "flashinfer"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    if aot:
        so = pkg / gb.AOT_REL
        so.parent.mkdir(parents=True)
        so.write_bytes(b"\x7fELF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    importlib.invalidate_caches()


@pytest.fixture
def no_nvcc(monkeypatch):
    monkeypatch.setattr(gb.shutil, "which", lambda _: None)
    for var in ("CUDA_HOME", "CUDA_PATH", gb.ENV):
        monkeypatch.delenv(var, raising=False)


def test_prebuilt_module_keeps_vllms_default(tmp_path, monkeypatch, no_nvcc):
    _fake_flashinfer(tmp_path, monkeypatch, aot=True)
    ok, why = gb.flashinfer_usable()
    assert ok and "prebuilt module" in why
    assert gb.choose() is None  # vLLM's default: FlashInfer on sm90
    assert "flashinfer" not in sys.modules  # decided without importing it


def test_flashinfer_without_module_or_nvcc_forces_triton(
    tmp_path, monkeypatch, no_nvcc
):
    _fake_flashinfer(tmp_path, monkeypatch, aot=False)
    assert gb.flashinfer_usable()[0] is False
    assert gb.choose() == "triton"
    monkeypatch.setattr(gb.shutil, "which", lambda _: "/usr/local/cuda/bin/nvcc")
    assert gb.choose() is None  # JIT possible


def test_explicit_choice_wins(tmp_path, monkeypatch, no_nvcc):
    _fake_flashinfer(tmp_path, monkeypatch, aot=True)
    monkeypatch.setenv(gb.ENV, "triton")
    assert gb.choose() == "triton"
    assert gb.choose("flashinfer") == "flashinfer"
    monkeypatch.setenv(gb.ENV, "flashinfr")
    with pytest.raises(ValueError):
        gb.choose()


def test_from_log():
    fi = "INFO 12-01 [gdn_linear_attn.py:146] Using FlashInfer GDN prefill kernel\n"
    tr = "INFO 12-01 [gdn_linear_attn.py:153] Using Triton/FLA GDN prefill kernel\n"
    assert gb.from_log(fi) == "flashinfer"
    assert gb.from_log(tr) == "triton"
    assert gb.from_log(fi + tr) == "flashinfer,triton"
    assert gb.from_log("Using FLASH_ATTN backend") is None


def test_gpu_check_judges_the_logged_kernel():
    run = {"rc": 0, "backends": ["FLASH_ATTN", "GDN_ATTN"], "gdn_prefill": "flashinfer"}
    report = {
        "gdn_prefill": {"expected": "flashinfer"},
        "runs": {"hybrid-base-eager": run},
    }
    checks = {c["check"]: c["ok"] for c in evaluate(copy.deepcopy(report))}
    assert checks["gdn_prefill"] is True
    report["runs"]["hybrid-base-eager"]["gdn_prefill"] = "triton"
    checks = {c["check"]: c["ok"] for c in evaluate(report)}
    assert checks["gdn_prefill"] is False
