# SPDX-License-Identifier: Apache-2.0
"""vLLM's real engine-args parser with the plugin's --speculative-config changes."""

import pytest

from vllm_dflash.entrypoints import arg_parser as cli


@pytest.fixture(scope="module")
def parser():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli.apply_arg()
    return EngineArgs.add_cli_args(FlexibleArgumentParser())


WANT = {"method": "dflash", "model": "/m/d", "num_speculative_tokens": 15}


@pytest.mark.parametrize(
    "argv",
    [
        ["--speculative-config", '{"method":"dflash","model":"/m/d","num_speculative_tokens":15}'],
        ["--speculative-config", "{method:dflash,model:/m/d,num_speculative_tokens:15}"],
        ["-sc", "{method: dflash, model: /m/d, num_speculative_tokens: 15}"],
        [
            "--speculative-config.method", "dflash",
            "--speculative-config.model", "/m/d",
            "--speculative-config.num_speculative_tokens", "15",
        ],
    ],
    ids=["json", "quote-stripped", "yaml-flow", "dotted"],
)  # fmt: skip
def test_forms_parse_to_the_same_dict(parser, argv):
    assert parser.parse_args(argv).speculative_config == WANT


def test_flag_has_its_own_help_group(parser):
    groups = [g for g in parser._action_groups if g.title == cli.GROUP_TITLE]
    assert len(groups) == 1 and "dflash" in groups[0].description
    assert any(
        "--speculative-config" in a.option_strings for a in groups[0]._group_actions
    )
    owners = [
        g
        for g in parser._action_groups
        for a in g._group_actions
        if "-sc" in a.option_strings
    ]
    assert owners == groups  # listed once


def test_bad_value_exits_with_one_line(parser, capsys):
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--speculative-config", "{method:dflash,model}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--speculative-config" in err and "quotes" in err
