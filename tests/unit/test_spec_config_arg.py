# SPDX-License-Identifier: Apache-2.0
import json

import pytest

from vllm_dflash.entrypoints.speculative_config import (
    SpecConfigParseError,
    parse_speculative_config,
)

WANT = {"method": "dflash", "model": "/m/d", "num_speculative_tokens": 15}


@pytest.mark.parametrize(
    "value",
    [
        json.dumps(WANT),
        "{method:dflash,model:/m/d,num_speculative_tokens:15}",
        "{method: dflash, model: /m/d, num_speculative_tokens: 15}",
        "  {method : dflash , model : /m/d , num_speculative_tokens : 15}  ",
        "{'method': 'dflash', 'model': '/m/d', 'num_speculative_tokens': 15}",
    ],
)
def test_inline_forms(value):
    assert parse_speculative_config(value) == WANT


def test_nested_and_scalars():
    got = parse_speculative_config(
        "{method:dflash,draft_tensor_parallel_size:1,enforce_eager:true,"
        "synthetic_acceptance_rates:[0.9,0.8],x:{y:null}}"
    )
    assert got == {
        "method": "dflash",
        "draft_tensor_parallel_size": 1,
        "enforce_eager": True,
        "synthetic_acceptance_rates": [0.9, 0.8],
        "x": {"y": None},
    }


def test_files(tmp_path):
    j = tmp_path / "spec.json"
    j.write_text(json.dumps(WANT))
    y = tmp_path / "spec.yaml"
    y.write_text("method: dflash\nmodel: /m/d\nnum_speculative_tokens: 15\n")
    assert parse_speculative_config(str(j)) == WANT
    assert parse_speculative_config("@" + str(j)) == WANT
    assert parse_speculative_config(str(y)) == WANT
    assert parse_speculative_config("@" + str(y)) == WANT


@pytest.mark.parametrize(
    "value, why",
    [
        ("dflash", "expected a mapping"),
        ("{method:dflash,model}", "has no ':'"),
        ("{method:{dflash}", "unbalanced"),
        ("/nope/spec.yaml", "not found"),
        ("@/nope/x", "not found"),
    ],
)
def test_errors_are_one_line_with_example(value, why):
    with pytest.raises(SpecConfigParseError) as e:
        parse_speculative_config(value)
    msg = str(e.value)
    assert why in msg and repr(value) in msg and "num_speculative_tokens" in msg
    assert "\n" not in msg


def test_yaml_is_safe(tmp_path):
    y = tmp_path / "evil.yaml"
    y.write_text("!!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(SpecConfigParseError):
        parse_speculative_config(str(y))
