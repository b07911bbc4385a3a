# SPDX-License-Identifier: Apache-2.0
"""The ``vllm-dflash`` command."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from vllm_dflash.version import __version__


def _doctor(args: argparse.Namespace) -> int:
    # vLLM logs to stdout; keep stdout for the report (``--json`` stays parseable).
    with contextlib.redirect_stdout(sys.stderr):
        from vllm_dflash.catalog import PATCHES
        from vllm_dflash.compat import platform_name, vllm_version_str
        from vllm_dflash.registry import apply_all

        results = apply_all(PATCHES, defer=False)
    report = {
        "vllm_dflash": __version__,
        "vllm": vllm_version_str(),
        "platform": platform_name(),
        "patches": [
            {
                "name": p.name,
                "kind": p.kind.value,
                "state": results[p.name].state.value,
                "reason": results[p.name].reason,
                "targets": list(p.targets),
                "upstream": p.upstream,
                "versions": p.versions,
                "summary": p.summary,
                "why": p.why,
                "future": p.future,
            }
            for p in PATCHES
        ],
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(
            f"vllm-dflash {__version__} | vLLM {report['vllm']} | platform {report['platform']}"
        )
        width = max(len(p["name"]) for p in report["patches"])
        for p in report["patches"]:
            extra = f" ({p['reason']})" if p["reason"] else ""
            print(f"  {p['name']:<{width}}  {p['state']}{extra}")
            print(f"  {'':<{width}}  {p['summary']} [{p['upstream']}]")
    failed = [p["name"] for p in report["patches"] if p["state"] == "failed"]
    return 1 if failed else 0


def _inspect(args: argparse.Namespace) -> int:
    from vllm_dflash.config.layer_types import DrafterConfigError
    from vllm_dflash.entrypoints.cli.inspect_drafter import (
        format_report,
        inspect_drafter,
    )

    try:
        report = inspect_drafter(args.drafter, args.target)
    except (DrafterConfigError, FileNotFoundError, KeyError) as e:
        print(f"vllm-dflash inspect: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-dflash", description="DFlash speculative decoding for vLLM 0.20.x"
    )
    parser.add_argument(
        "--version", action="version", version=f"vllm-dflash {__version__}"
    )
    sub = parser.add_subparsers(dest="command")
    doctor = sub.add_parser("doctor", help="vLLM version, platform and patch states")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    ins = sub.add_parser(
        "inspect", help="resolved DFlash settings of a drafter checkpoint"
    )
    ins.add_argument(
        "drafter", help="local drafter directory (config.json + safetensors)"
    )
    ins.add_argument("--target", help="local target directory to validate against")
    ins.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return _doctor(args)
    if args.command == "inspect":
        return _inspect(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
