# SPDX-License-Identifier: Apache-2.0
"""A usable ``--speculative-config`` and DFlash config validation before weights load."""

from __future__ import annotations

import inspect
import sys

from vllm_dflash.import_hooks import when_imported
from vllm_dflash.registry import (
    ALL_PLATFORMS,
    V020,
    Patch,
    PatchKind,
    is_patched,
    original,
)

ARG_NAME = "cli_speculative_config"
VALIDATE_NAME = "dflash_config_validation"
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

    from vllm_dflash.entrypoints.speculative_config import (
        EXAMPLE,
        HELP_LINE,
        parse_speculative_config,
    )

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

    if is_patched(EngineArgs.add_cli_args, ARG_NAME):
        return
    stock = EngineArgs.add_cli_args

    def add_cli_args(parser):
        parser = stock(parser)
        improve_parser(parser)
        return parser

    _mark(add_cli_args, ARG_NAME, stock)
    EngineArgs.add_cli_args = staticmethod(add_cli_args)


# --- drafter config validation --------------------------------------------------


def probe_validate() -> bool:
    return True  # no vLLM release validates DFlash drafter configs


def plugin_error(error: ValueError) -> ValueError | None:
    """The plugin's one-line error inside a pydantic ``ValidationError`` (a check
    that runs while ``VllmConfig`` validates, e.g. ``dflash_full_step_budget``)."""
    from vllm_dflash.config.layer_types import DrafterConfigError

    if isinstance(error, DrafterConfigError):
        return error
    errors = getattr(error, "errors", None)
    if not callable(errors):
        return None
    for item in errors():
        inner = (item.get("ctx") or {}).get("error")
        if isinstance(inner, DrafterConfigError):
            return inner
    return None


def apply_validate() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dflash.config.drafter_validation import (
        prevalidate_raw,
        validate_vllm_config,
    )

    if not is_patched(EngineArgs.create_engine_config, VALIDATE_NAME):
        stock_create = EngineArgs.create_engine_config

        def create_engine_config(self, *args, **kwargs):
            prevalidate_raw(self.speculative_config)
            try:
                config = stock_create(self, *args, **kwargs)
            except ValueError as e:
                ours = plugin_error(e)
                if ours is None:
                    raise
                raise ours from None
            validate_vllm_config(config)
            return config

        _mark(create_engine_config, VALIDATE_NAME, stock_create)
        EngineArgs.create_engine_config = create_engine_config

    # `vllm serve` imports its subcommand lazily (~2 s): wrap it when it does.
    when_imported("vllm.entrypoints.cli.serve", _wrap_serve_cmd)


def _wrap_serve_cmd() -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand

    from vllm_dflash.config.layer_types import DrafterConfigError
    from vllm_dflash.registry import PatchError

    if not is_patched(ServeSubcommand.cmd, VALIDATE_NAME):
        stock_cmd = ServeSubcommand.cmd

        def cmd(args) -> None:
            try:
                stock_cmd(args)
            except (DrafterConfigError, PatchError) as e:
                print(f"vllm serve: error: {e}", file=sys.stderr)
                sys.exit(2)

        _mark(cmd, VALIDATE_NAME, stock_cmd)
        ServeSubcommand.cmd = staticmethod(cmd)


ARG_PATCH = Patch(
    name=ARG_NAME,
    kind=PatchKind.FEATURE,
    targets=("vllm.engine.arg_utils:EngineArgs.add_cli_args",),
    summary=(
        "--speculative-config accepts quote-stripped JSON, YAML flow, @file and "
        ".json/.yaml paths, and is listed in plain `vllm serve --help`."
    ),
    why="0.20.x hides the flag from --help and rejects JSON whose quotes a shell stripped.",
    upstream="none, vllm-dflash feature",
    versions=V020,
    platforms=ALL_PLATFORMS,
    probe=probe_arg,
    apply=apply_arg,
    future="Propose the lenient parser upstream.",
)

VALIDATE_PATCH = Patch(
    name=VALIDATE_NAME,
    kind=PatchKind.FEATURE,
    targets=(
        "vllm.engine.arg_utils:EngineArgs.create_engine_config",
        "vllm.entrypoints.cli.serve:ServeSubcommand.cmd",
    ),
    summary="One-line errors for bad DFlash drafter configs, before weights load.",
    why="Mistakes otherwise surface as shape errors deep in loading, or silent low acceptance.",
    upstream="none, vllm-dflash feature",
    versions=V020,
    platforms=ALL_PLATFORMS,
    probe=probe_validate,
    apply=apply_validate,
    future="Propose the checks upstream (SpeculativeConfig).",
)
