# SPDX-License-Identifier: Apache-2.0
"""benchmarks/gpu/hybrid_pair.py on CPU: arguments, engine kwargs, log parsing,
the kv_memory prediction and the output comparison (the engines run on a GPU)."""

from __future__ import annotations

import json

from benchmarks.gpu import hybrid_pair as hp

LOG = """
INFO 12-01 10:00:00 [interface.py:606] Setting attention block size to 960 tokens to ensure that attention page size is >= mamba page size.
INFO 12-01 10:01:00 [gpu_worker.py:441] Available KV cache memory: 61.57 GiB
INFO 12-01 10:01:01 [kv_cache_utils.py:1708] GPU KV cache size: 268,738 tokens
INFO 12-01 10:01:01 [kv_cache_utils.py:1710] Maximum concurrency for 8,192 tokens per request: 32.80x
"""


def test_parse_args_and_engine_kwargs(tmp_path, monkeypatch):
    # no flashinfer that can run its GDN prefill here: triton (gdn_backend.choose)
    monkeypatch.delenv("GDN_PREFILL", raising=False)
    monkeypatch.setattr(hp.gdn_backend, "flashinfer_usable", lambda: (False, "test"))
    args = hp.parse_args([str(tmp_path / "o.jsonl"), "--root", str(tmp_path / "m")])
    assert args.stages == hp.DEFAULT_STAGES.split(",") and args.conc == [1, 8, 32]
    kw = hp.engine_kwargs("dflash_fp8", args)
    assert kw["kv_cache_dtype"] == "fp8" and kw["enforce_eager"]
    assert kw["speculative_config"]["num_speculative_tokens"] == 15
    assert kw["max_num_seqs"] == 32 and kw["enable_prefix_caching"] is False
    assert kw["gdn_prefill_backend"] == "triton"
    target = json.loads((tmp_path / "m" / "target" / "config.json").read_text())
    assert target["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert "speculative_config" not in hp.engine_kwargs("nospec_fp8", args)
    assert hp.engine_kwargs("dflash_bf16", args)["kv_cache_dtype"] == "auto"
    assert hp.STAGES["dflash_fp8_stock"]["env"] == {
        "VLLM_DFLASH_DISABLE": "dflash_drafter_kv_cache_dtype"
    }
    one = hp.parse_args(["r.json", "--one", "nospec_fp8"] + hp._passthrough(args))
    assert one.one == "nospec_fp8" and one.conc == args.conc and one.k == 15
    assert one.gdn == "triton"
    # flashinfer usable: vLLM's default (FlashInfer on sm90), kept by the stage processes
    monkeypatch.setattr(hp.gdn_backend, "flashinfer_usable", lambda: (True, "test"))
    fi = hp.parse_args([str(tmp_path / "o.jsonl"), "--root", str(tmp_path / "m")])
    assert fi.gdn == "" and "gdn_prefill_backend" not in hp.engine_kwargs(
        "dflash_fp8", fi
    )
    assert (
        hp.parse_args(["r.json", "--one", "nospec_fp8"] + hp._passthrough(fi)).gdn == ""
    )


def test_parse_log_and_prediction(tmp_path):
    args = hp.parse_args([str(tmp_path / "o.jsonl")])
    got = hp.parse_log(LOG + "AssertionError\n")
    assert got["available_kv_gib"] == 61.57 and got["max_concurrency"] == 32.8
    assert (
        got["gpu_kv_cache_tokens"] == 268738 and got["max_concurrency_tokens"] == 8192
    )
    assert got["attention_block_size"] == 960 and got["error_lines"] == [
        "AssertionError"
    ]
    assert "gdn_prefill" not in got
    assert (
        hp.parse_log("Using FlashInfer GDN prefill kernel")["gdn_prefill"]
        == "flashinfer"
    )
    # the 2026-12-01 engines ran vLLM's own layout (1 + k GDN state copies)
    p = hp.predict("dflash_fp8_copies", args, 61.57)
    assert (p["block_size"], p["groups"], p["max_concurrency"]) == (960, 15, 32.8)
    assert hp.predict("dflash_bf16_copies", args, 61.57)["max_concurrency"] == 26.9
    # the plugin's layout (replay ring, drafter in the target's group): 4 groups of 21
    p = hp.predict("dflash_bf16", args, 61.57)
    assert (p["block_size"], p["groups"], p["max_concurrency"]) == (544, 4, 74.32)
    assert "asserts" in hp.predict("dflash_fp8_stock", args, 61.57)["error"]


def test_compare():
    r = {
        "dflash_fp8": {"outputs": {"1": [[1, 2, 3]], "8": [[1, 2, 4]]}},
        "nospec_fp8": {"outputs": {"1": [[1, 2, 3]]}},
    }
    c = hp.compare(r)
    assert c["dflash_fp8: conc 1 vs others"] == {"8": 0.6667}
    assert c["dflash_fp8 vs nospec_fp8 (conc 1)"] == 1.0
