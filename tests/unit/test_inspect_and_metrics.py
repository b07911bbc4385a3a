# SPDX-License-Identifier: Apache-2.0
import pytest

from vllm_dflash.entrypoints.cli.inspect_drafter import inspect_drafter
from vllm_dflash.entrypoints.cli.main import main
from vllm_dflash.testing.metrics import acceptance_length, parse_spec_decode


def test_inspect_swa_fixture(tiny_models):
    r = inspect_drafter(str(tiny_models.swa), str(tiny_models.target))
    assert r["block_size"] == 8 and r["max_num_speculative_tokens"] == 7
    assert r["target_layer_ids"] == [0, 2, 4] and r["vllm_capture_indices"] == [1, 3, 5]
    assert [x["attention"] for x in r["layers"]] == ["sliding_attention"] * 2 + [
        "full_attention"
    ]
    assert [x["window"] for x in r["layers"]] == [6, 6, None]
    # 3 layers x (K+V) x 2 kv heads x 32 head_dim x 4 bytes (fp32)
    assert r["draft_kv_bytes_per_token"] == 3 * 2 * 2 * 32 * 4
    assert r["parameters"] > 0 and r["validated_against"]


def test_inspect_cli_rejects_bad_drafter(tiny_models, tmp_path, capsys):
    from tests.helpers.bad_drafters import make

    bad = make(
        tiny_models.dense,
        tmp_path / "bad",
        {"dflash_config.target_layer_ids": [1, 1, 4]},
    )
    assert main(["inspect", str(bad), "--target", str(tiny_models.target)]) == 2
    err = capsys.readouterr().err
    assert "repeats [1]" in err and err.count("\n") == 1


def test_parse_metrics():
    text = "\n".join(
        [
            "# HELP vllm:spec_decode_num_drafts_total x",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0',
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 25.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 9.0',
            "vllm:spec_decode_num_drafts_created 1795971735.4",
            "vllm:other_total 3.0",
        ]
    )
    c = parse_spec_decode(text)
    assert c["vllm:spec_decode_num_drafts"] == 10.0
    assert not any(k.endswith("_created") for k in c)
    assert c["vllm:spec_decode_num_accepted_tokens_per_pos[0]"] == 9.0
    assert acceptance_length(c) == pytest.approx(3.5)
