# SPDX-License-Identifier: Apache-2.0
"""``vllm-dflash inspect --target`` memory report (issue #22 item 6).

``vllm_dflash.config.kv_memory`` (no vLLM import) against vLLM 0.20.1's own spec,
grouping and concurrency functions (``tests/helpers/kv_specs.py``), on the tiny
hybrid fixture and the Qwen3.6-27B shapes, and against the H200 measurements.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.helpers import kv_specs
from vllm_dflash.config import kv_memory
from vllm_dflash.entrypoints.cli.main import main

GIB = 1024**3


def _tiny() -> tuple[dict, dict]:
    from vllm_dflash.testing.tiny_hybrid import _TEXT, HYBRID_DRAFTER, hybrid_config
    from vllm_dflash.testing.tiny_models import drafter_config

    target = hybrid_config()
    for cfg in (target, target["text_config"]):
        cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    drafter = drafter_config(HYBRID_DRAFTER, _TEXT)
    return target, drafter


CASES = [
    # (drafter?, k, kv dtype)
    (False, 0, "auto"),
    (True, 15, "auto"),
    (True, 3, "auto"),
    (True, 15, "fp8"),  # drafter in fp8 (dflash_drafter_kv_cache_dtype / vLLM 0.22+)
    (False, 0, "fp8"),
]


@pytest.mark.parametrize("mode", ["none", "align"])
@pytest.mark.parametrize(
    "replay,shared", [(True, True), (True, False), (False, False)],
    ids=["plugin", "replay-only", "vllm"],
)  # fmt: skip
@pytest.mark.parametrize("shapes", ["tiny", "27b"])
@pytest.mark.parametrize("with_drafter,k,kv", CASES)
def test_plan_equals_vllm_layout(shapes, with_drafter, k, kv, replay, shared, mode):
    target, drafter = _tiny() if shapes == "tiny" else kv_specs.load_27b()
    if shapes == "tiny" and with_drafter:
        k = min(k, drafter["block_size"] - 1)
    drafter = drafter if with_drafter else None
    replay = replay and drafter is not None
    available = int((0.05 if shapes == "tiny" else 61.57) * GIB)
    vc = kv_specs.vllm_config_for(target, k, kv, mamba_cache_mode=mode)
    cc = SimpleNamespace(cache_dtype=kv) if drafter else None
    specs = kv_specs.build_specs(
        target, drafter, vc, cc, gdn_replay=replay, drafter_kv_shared=shared
    )
    vllm = kv_specs.layout(vc, specs, available)
    p = kv_memory.plan(
        target, drafter, k, kv, context=8192, gdn_replay=replay,
        drafter_kv_shared=shared, prefix_caching=mode == "align",
    )  # fmt: skip
    assert p.error is None
    assert p.block_size == vllm["block_size"]
    assert p.page == vllm["page"]
    assert sum(p.groups.values()) == len(vllm["groups"])
    assert p.group_size == max(len(g.layer_names) for g in vllm["groups"])
    assert p.num_blocks(available) == vllm["num_blocks"]
    assert p.max_concurrency(available) == pytest.approx(vllm["max_concurrency"])


def test_27b_h200_numbers():
    """The H200 runs: 26.9 (DFlash k=15) vs 111.3 (no spec) at 8k, 0.85 utilisation."""
    target, drafter = kv_specs.load_27b()
    dflash = kv_memory.plan(
        target, drafter, 15, "auto", 8192, gdn_replay=False, drafter_kv_shared=False
    )
    nospec = kv_memory.plan(target, None, 0, "auto", 8192)
    # GDN: 1 + k = 16 copies of (conv 10240 x 18 + SSM 48 x 128 x 128) x 2 bytes
    assert (dflash.gdn_conv, dflash.gdn_ssm) == (368_640, 1_572_864)
    assert dflash.gdn_bytes_per_request == 48 * 16 * 1_941_504
    assert dflash.target_kv_per_token == 16 * 4096
    assert dflash.drafter_kv_per_token == 5 * 4096  # sliding layers full size
    assert (dflash.block_size, dflash.group_size, dflash.blocks_per_request) == (
        480,
        5,
        250,
    )
    assert (nospec.block_size, nospec.group_size, nospec.blocks_per_request) == (
        400,
        16,
        24,
    )
    # KV memory from the engine's own numbers, and from the formula's defaults
    assert round(dflash.max_concurrency(int(61.57 * GIB)), 1) == 26.9
    assert round(nospec.max_concurrency(int(65.21 * GIB)), 1) == 111.3
    weights = kv_memory.estimate_params(target) * 2
    d_weights = kv_memory.estimate_params(drafter, drafter=True) * 2
    avail = kv_memory.available_kv_bytes(140.4, 0.85, weights + d_weights, 3.2)
    base = kv_memory.available_kv_bytes(140.4, 0.85, weights, 3.2)
    assert dflash.max_concurrency(avail) == pytest.approx(26.9, rel=0.02)
    assert nospec.max_concurrency(base) == pytest.approx(111.3, rel=0.01)


def test_27b_h100_prefix_caching_numbers():
    """The H100 chat engine (2026-12-06, 7d29628): DFlash k = 15 + prefix caching
    with vLLM's 1 + k GDN copies had 7.99 GiB of KV memory and a max concurrency of
    3.36 at 8k. The plugin's layout in the same memory: 8.32 (one GDN state + ring,
    drafter in the target's group)."""
    target, drafter = kv_specs.load_27b()
    mem = int(7.99 * GIB)
    copies = kv_memory.plan(
        target, drafter, 15, "auto", 8192, gdn_replay=False,
        drafter_kv_shared=False, prefix_caching=True,
    )  # fmt: skip
    plugin = kv_memory.plan(target, drafter, 15, "auto", 8192, prefix_caching=True)
    assert copies.max_concurrency(mem) == pytest.approx(3.36, abs=0.01)
    assert (copies.block_size, plugin.block_size) == (480, 544)
    assert round(plugin.max_concurrency(mem), 2) == 8.32


def test_stock_fp8_reports_the_assertion():
    target, drafter = kv_specs.load_27b()
    p = kv_memory.plan(target, drafter, 15, "fp8", drafter_follows_kv_dtype=False)
    assert "asserts" in p.error and p.max_concurrency(10 * GIB) == 0.0


def test_inspect_cli_memory_report(tmp_path, capsys):
    target, drafter = kv_specs.load_27b()
    for name, cfg in (("t", target), ("d", drafter)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    args = ["inspect", str(tmp_path / "d"), "--target", str(tmp_path / "t")]
    mem = ["--gpu-memory-gib", "140.4", "--gpu-memory-utilization", "0.85"]
    assert main(args + mem + ["--want-concurrency", "32", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)["memory"]
    assert m["num_speculative_tokens"] == 15  # block_size - 1
    # one state + a bf16 ring of 16 records per GDN layer (dflash_gdn_state_replay)
    ring = 2 * (64 + 16 * (16 * 128 + 48 * 128 + 2 * 48))
    assert m["gdn_replay"] and m["gdn_ring_bytes"] == ring
    assert m["gdn_bytes_per_request"] == 48 * (1_941_504 + ring)
    assert m["vllm_copies_max_concurrency"] == pytest.approx(26.9, rel=0.02)
    assert m["max_concurrency"] > 2.4 * m["vllm_copies_max_concurrency"]
    assert m["no_spec_max_concurrency"] == pytest.approx(111.3, rel=0.01)
    assert m["max_concurrency_by_k"]["1"] > m["max_concurrency_by_k"]["15"]
    assert any(h.startswith("k <= ") for h in m["suggestions"])
    assert main(args + mem + ["-k", "7", "--kv-cache-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "k=7" in out and "GDN state / request" in out and "max concurrency" in out
    assert main(args) == 0  # no GPU memory given: per-request bytes only
    out = capsys.readouterr().out
    assert "KV / request" in out and "1 state + ring" in out
    assert main(args + mem + ["--vllm-gdn-copies", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)["memory"]
    assert m["gdn_bytes_per_request"] == 48 * 16 * 1_941_504
    assert m["max_concurrency"] == pytest.approx(26.9, rel=0.02)


@pytest.mark.parametrize("kv,drafter_kv_heads", [("auto", 8), ("fp8", 8), ("auto", 16)])
def test_dense_target_plan_equals_vllm(kv, drafter_kv_heads):
    """Attention-only target (Qwen3-8B-shaped): one group of all layers."""
    target = {
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "num_hidden_layers": 36, "intermediate_size": 12288, "vocab_size": 151936,
        "torch_dtype": "bfloat16",
    }  # fmt: skip
    drafter = dict(target, num_hidden_layers=5, num_key_value_heads=drafter_kv_heads)
    vc = kv_specs.vllm_config_for(target, 15, kv)
    specs = {f"t.{i}": kv_specs._attention_spec(vc, kv, 8, 128) for i in range(36)}
    specs |= {
        f"d.{i}": kv_specs._attention_spec(vc, kv, drafter_kv_heads, 128)
        for i in range(5)
    }
    available = 20 * GIB
    vllm = kv_specs.layout(vc, specs, available)
    p = kv_memory.plan(target, drafter, 15, kv)
    assert len(vllm["groups"]) == 1 and not p.hybrid
    assert p.num_blocks(available) == vllm["num_blocks"]
    assert p.max_concurrency(available) == pytest.approx(vllm["max_concurrency"])
