# SPDX-License-Identifier: Apache-2.0
"""``--speculative-config`` typed without quotes: bash makes the argv, vLLM's real
``vllm serve`` parser (with patch cli_speculative_config_shell_split) reads it.

Each case is a command line as typed; bash (``bash -c``, or twice as ssh does)
turns it into argv words, which go to the parser in this process. No engine.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import restore_after
from vllm_dflash.entrypoints import arg_parser as cli
from vllm_dflash.entrypoints import argv_rebuild as spec_config_argv
from vllm_dflash.entrypoints.speculative_config import HOW_TO_FIX

SEED = {"method": "dflash", "model": "/path/to/drafter", "num_speculative_tokens": 15}
SPACED = (
    '{"method": "dflash", "model": "/path/to/drafter", "num_speculative_tokens": 15}'
)
TIGHT = '{"method":"dflash","model":"/path/to/drafter","num_speculative_tokens":15}'
NESTED = {
    "method": "dflash",
    "model": "/models/run:7/drafter",
    "num_speculative_tokens": 4,
    "enforce_eager": True,
    "disable_padded_drafter_batch": False,
    "synthetic_acceptance_rates": [0.9, 0.5, 1],
    "draft_load_config": {
        "load_format": "dummy",
        "download_dir": "http://cache.local:8080/dl",
        "model_loader_extra_config": {"a": [1, 2], "b": None},
    },
    "revision": "main",
}


@pytest.fixture(scope="module")
def parser():
    """The argument parser of ``vllm serve``, patched through the registry (so
    VLLM_DFLASH_DISABLE=cli_speculative_config_shell_split turns the tests red).
    Building it loads vLLM's general plugins, i.e. applies every patch of this
    platform in this process: the module's end restores every patch target, so
    that the test files after it in the same process see stock vLLM."""
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_dflash.catalog import PATCHES
    from vllm_dflash.registry import evaluate

    with pytest.MonkeyPatch.context() as mp:
        for patch in PATCHES:
            restore_after(mp, patch)
        cli.apply_arg()
        evaluate(spec_config_argv.PATCH, apply=True)
        yield make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


@pytest.fixture(scope="module")
def argv_sh(tmp_path_factory) -> str:
    """A script that prints its argv NUL-separated (a path without shell specials)."""
    path = tmp_path_factory.mktemp("sh") / "argv.sh"
    path.write_text("printf '%s\\0' \"$@\"\n")
    return str(path)


def bash(line: str) -> list[str]:
    out = subprocess.run(["bash", "-c", line], capture_output=True, check=True)
    return out.stdout.decode().split("\0")[:-1]


def typed(argv_sh: str, args: str) -> list[str]:
    """argv of ``vllm serve <args>`` typed in bash."""
    return bash(f"sh {argv_sh} {args}")


def through_ssh(argv_sh: str, args: str) -> list[str]:
    """argv of ``ssh host vllm serve <args>``: the local shell removes one level of
    quotes, ssh joins the words with spaces and the remote shell parses them again."""
    return bash(f'ssh_like() {{ bash -c "$*"; }}; ssh_like sh {argv_sh} {args}')


def spec(parser, argv: list[str]) -> dict:
    ns = parser.parse_args(argv)
    assert ns.model_tag == "m" and ns.port == 8001, vars(ns)
    return ns.speculative_config


@pytest.mark.parametrize("json_text", [SPACED, TIGHT], ids=["spaces", "no-spaces"])
@pytest.mark.parametrize(
    "template",
    [
        "m -sc {j} --port 8001",
        "m --port 8001 --speculative-config {j}",
        "m --speculative-config={j} --port 8001",
        "--speculative_config {j} m --port 8001",  # model tag right after the value
        "-sc {j} --port 8001 m",
    ],
)
def test_unquoted_json_as_bash_delivers_it(parser, argv_sh, json_text, template):
    argv = typed(argv_sh, template.format(j=json_text))
    assert len(argv) > 4  # bash did take it apart
    assert spec(parser, argv) == SEED


@pytest.mark.parametrize("json_text", [SPACED, TIGHT], ids=["spaces", "no-spaces"])
def test_through_ssh(parser, argv_sh, json_text):
    # Typed locally with single quotes, as the README's quoted-JSON form says;
    # ssh drops them on the way to the remote shell.
    argv = through_ssh(argv_sh, f"m -sc '{json_text}' --port 8001")
    assert spec(parser, argv) == SEED
    # The same twice-parsed line as `bash -c "bash -c '...'"`.
    inner = f"sh {argv_sh} m -sc {json_text} --port 8001".replace('"', '\\"')
    assert spec(parser, bash(f"bash -c \"bash -c '{inner}'\"")) == SEED


def test_ssh_keeps_the_recommended_forms(parser, argv_sh, tmp_path):
    """What the error messages and the README recommend arrives intact."""
    f = tmp_path / "spec.json"
    f.write_text(TIGHT)
    dotted = (
        "--speculative-config.method dflash --speculative-config.model "
        "/path/to/drafter --speculative-config.num_speculative_tokens 15"
    )
    for args in (f"m {dotted} --port 8001", f"m -sc @{f} --port 8001"):
        assert spec(parser, through_ssh(argv_sh, args)) == SEED
        assert spec(parser, typed(argv_sh, args)) == SEED
    assert spec(parser, typed(argv_sh, f"m -sc '{SPACED}' --port 8001")) == SEED


@pytest.mark.parametrize("spaces", [True, False], ids=["spaces", "no-spaces"])
def test_nested_values_and_colons(parser, argv_sh, spaces):
    import json

    text = json.dumps(NESTED, separators=(", ", ": ") if spaces else (",", ":"))
    argv = typed(argv_sh, f"m -sc {text} --port 8001")
    assert spec(parser, argv) == NESTED


@pytest.mark.parametrize(
    "args, why",
    [
        (f"m -sc {SPACED[:-1]} --port 8001", "opens more braces than it closes"),
        (f"m -sc {SPACED[:-1]}", "argv ends"),
        (
            'm -sc {"method":"dflash","synthetic_acceptance_rates":[0.9,0.8} --port 8001',
            "unbalanced brackets",
        ),
        ('m -sc {"method": "dflash",, "model": "/p"} --port 8001', "has no ':'"),
    ],
    ids=["unclosed-brace", "unclosed-at-end", "unclosed-list", "empty-entry"],
)
def test_unrebuildable_values_fail_with_one_line(parser, argv_sh, capsys, args, why):
    argv = typed(argv_sh, args)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert why in err and "argument -sc" in err and HOW_TO_FIX in err, err
    assert "--port" not in err or "next word is '--port'" in err


@pytest.mark.parametrize("json_text", [SPACED, TIGHT], ids=["spaces", "no-spaces"])
def test_a_stray_word_is_never_swallowed(parser, argv_sh, capsys, json_text):
    with pytest.raises(SystemExit) as e:
        parser.parse_args(typed(argv_sh, f"m -sc {json_text} stray --port 8001"))
    assert e.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .endswith("unrecognized arguments: stray")
    )


def test_other_values_are_left_alone(parser):
    from vllm_dflash.entrypoints.speculative_config import rebuild_split_config

    argv = ["m", "-sc", "{method:dflash}", "--model-loader-extra-config", "{a:", "1}"]
    assert rebuild_split_config(argv, {"method"}) == (argv, [])
    # A model tag that looks like key:value but is no SpeculativeConfig field.
    argv = ["-sc", "method:dflash", "s3:bucket/model", "--port", "8001"]
    out, rebuilt = rebuild_split_config(argv, {"method"})
    assert out == ["-sc", '{"method": "dflash"}', "s3:bucket/model", "--port", "8001"]
    assert rebuilt[0].words == ("-sc", "method:dflash")


def test_probe_asks_vllms_parser():
    # Stock vLLM 0.20.x rejects both mangled forms: the patch is needed.
    assert spec_config_argv.probe() is True
