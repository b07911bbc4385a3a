# SPDX-License-Identifier: Apache-2.0
"""A usable ``--speculative-config`` and DFlash config validation before weights load."""

from __future__ import annotations

import inspect
import sys

from vllm_dflash.patches.registry import is_patched, original

PATCH_ARG = "cli_speculative_config"
PATCH_VALIDATE = "dflash_config_validation"
GROUP_TITLE = "SpeculativeDecoding"


def _mark(fn, patch: str, stock) -> None:
    fn.__vllm_dflash_patch__ = patch
    fn.__wrapped_original__ = stock


# --- --speculative-config ------------------------------------------------------


def probe_arg() -> bool:
    from vllm.engine.arg_utils import EngineArgs

    src = inspect.getsource(original(EngineArgs.add_cli_args))
    return "optional_type(json.loads)" in src


def improve_parser(parser) -> None:
    """Accept shell-mangled values and list the flag in plain ``--help``."""
    from vllm.engine.arg_utils import optional_type

    from vllm_dflash.spec_config_arg import EXAMPLE, HELP_LINE, parse_speculative_config

    action = next(
        (a for a in parser._actions if "--speculative-config" in a.option_strings), None
    )
    if action is None:
        raise RuntimeError("vLLM's parser has no --speculative-config")
    action.type = optional_type(parse_speculative_config)
    action.help = (
        "Speculative decoding config: quoted JSON, @file or a .json/.yaml path, or "
        "vLLM's dotted form (--speculative-config.method dflash ...); JSON whose "
        "quotes a shell stripped and YAML flow mappings are read too. "
        f"Example (DFlash): {EXAMPLE}"
    )
    for group in parser._action_groups:
        if action in group._group_actions and group.title != GROUP_TITLE:
            group._group_actions.remove(action)
    if not any(g.title == GROUP_TITLE for g in parser._action_groups):
        group = parser.add_argument_group(title=GROUP_TITLE, description=HELP_LINE)
        group._group_actions.append(action)


def apply_arg() -> None:
    from vllm.engine.arg_utils import EngineArgs

    if is_patched(EngineArgs.add_cli_args, PATCH_ARG):
        return
    stock = EngineArgs.add_cli_args

    def add_cli_args(parser):
        parser = stock(parser)
        improve_parser(parser)
        return parser

    _mark(add_cli_args, PATCH_ARG, stock)
    EngineArgs.add_cli_args = staticmethod(add_cli_args)


# --- drafter config validation --------------------------------------------------


def probe_validate() -> bool:
    return True  # no vLLM release validates DFlash drafter configs


def apply_validate() -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand

    from vllm_dflash.model.layer_types import DrafterConfigError
    from vllm_dflash.validation import prevalidate_raw, validate_vllm_config

    if not is_patched(EngineArgs.create_engine_config, PATCH_VALIDATE):
        stock_create = EngineArgs.create_engine_config

        def create_engine_config(self, *args, **kwargs):
            prevalidate_raw(self.speculative_config)
            config = stock_create(self, *args, **kwargs)
            validate_vllm_config(config)
            return config

        _mark(create_engine_config, PATCH_VALIDATE, stock_create)
        EngineArgs.create_engine_config = create_engine_config

    if not is_patched(ServeSubcommand.cmd, PATCH_VALIDATE):
        stock_cmd = ServeSubcommand.cmd

        def cmd(args) -> None:
            try:
                stock_cmd(args)
            except DrafterConfigError as e:
                print(f"vllm serve: error: {e}", file=sys.stderr)
                sys.exit(2)

        _mark(cmd, PATCH_VALIDATE, stock_cmd)
        ServeSubcommand.cmd = staticmethod(cmd)
