# SPDX-License-Identifier: Apache-2.0
"""``--speculative-config`` JSON that a shell took apart is put back together.

Typed without quotes (or sent through ssh, which drops one level of quoting),
``--speculative-config {"method": "dflash", "model": "/m", ...}`` reaches argv
as several words: bash removes the quotes and splits at the spaces
(``{method:`` ``dflash,`` ``model:`` ``/m,`` ...), or, without spaces, brace
expansion makes one word per entry (``method:dflash`` ``model:/m`` ...). vLLM
then fails with ``Value {method: cannot be converted to <function loads>``.

One hook on vLLM's argument parsing, ``FlexibleArgumentParser.parse_args``, which
every entry point calls once with the whole argv (``vllm serve``, ``vllm bench``,
``python -m vllm.entrypoints.openai.api_server``): plugins are loaded while those
parsers are built (``AsyncEngineArgs.add_cli_args``), before parse_args runs. The
words are rebuilt into one strict-JSON value before vLLM sees argv, with one INFO
line saying what was rebuilt; words that do not form a mapping give a one-line
argparse error (exit 2) that names the forms that survive shells.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from typing_extensions import override

from vllm_dflash.entrypoints.speculative_config import (
    FLAGS,
    ShellSplitError,
    rebuild_split_config,
)
from vllm_dflash.registry import (
    ALL_PLATFORMS,
    V020,
    Patch,
    PatchKind,
    PatchState,
    original,
    replace_attr,
)

NAME = "cli_speculative_config_shell_split"

# What bash makes of '{"method": "dflash", "num_speculative_tokens": 4}' and of
# '{"method":"dflash","num_speculative_tokens":4}' once the quotes are gone.
_PROBE_ARGVS = (
    ["m", "-sc", "{method:", "dflash,", "num_speculative_tokens:", "4}"],
    ["m", "-sc", "method:dflash", "num_speculative_tokens:4"],
)
_PROBE_WANT = {"method": "dflash", "num_speculative_tokens": 4}


class _Rejected(Exception):
    pass


def _probe_parser() -> argparse.ArgumentParser:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class ProbeParser(FlexibleArgumentParser):
        @override
        def error(self, message: str):  # type: ignore[override]
            raise _Rejected(message)

    parser = ProbeParser(add_help=False)
    parser.add_argument("model_tag", nargs="?")
    parser.add_argument("--speculative-config", "-sc", type=json.loads)
    return parser


def probe() -> bool:
    """Ask vLLM's own parse_args to parse both shell-mangled argvs."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    stock = original(FlexibleArgumentParser.parse_args)
    for argv in _PROBE_ARGVS:
        try:
            got = stock(_probe_parser(), list(argv)).speculative_config
        except _Rejected:
            return True
        if got != _PROBE_WANT:
            return True
    return False


def _spec_config_fields() -> frozenset[str]:
    from vllm.config import SpeculativeConfig

    return frozenset(f.name for f in dataclasses.fields(SpeculativeConfig))


def _knows_flag(parser: argparse.ArgumentParser) -> bool:
    """Whether this parser or one of its subcommands has --speculative-config."""
    if any(f in parser._option_string_actions for f in FLAGS):
        return True
    return any(
        _knows_flag(sub)
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for sub in action.choices.values()
    )


def apply() -> None:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_dflash.logger import init_logger

    logger = init_logger(__name__)
    stock = original(FlexibleArgumentParser.parse_args)

    def parse_args(self, args=None, namespace=None) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        if _knows_flag(self):
            try:
                argv, rebuilt = rebuild_split_config(argv, _spec_config_fields())
            except ShellSplitError as e:
                self.error(str(e))
            for r in rebuilt:
                logger.info(
                    "vllm-dflash: %s arrived taken apart by a shell (quotes lost, e.g. "
                    "through ssh) as %d argv words %s; rebuilt it as %s",
                    r.flag,
                    len(r.words),
                    " ".join(r.words),
                    json.dumps(r.config),
                )
        return stock(self, argv, namespace)

    replace_attr(FlexibleArgumentParser, "parse_args", parse_args, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FEATURE,
    targets=("vllm.utils.argparse_utils:FlexibleArgumentParser.parse_args",),
    summary=(
        "A --speculative-config JSON value that bash word-split or brace-expanded "
        "(quotes lost, e.g. through ssh) is rebuilt into one value before vLLM parses "
        "argv; one INFO line says what was rebuilt."
    ),
    why=(
        "Unquoted JSON reaches argv as '{method:' 'dflash,' ... or 'method:dflash' "
        "'model:/m' ...: stock vLLM fails with 'Value {method: cannot be converted'."
    ),
    upstream="none, vllm-dflash feature",
    versions=V020,
    platforms=ALL_PLATFORMS,
    probe=probe,
    apply=apply,
    future="Propose upstream in FlexibleArgumentParser.parse_args.",
    when_probe_false=PatchState.NOT_NEEDED,
    probe_false_reason="probe: vLLM's parse_args already rebuilds shell-split JSON",
)
