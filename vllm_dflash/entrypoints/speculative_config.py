# SPDX-License-Identifier: Apache-2.0
"""Parsing of ``--speculative-config`` values that survive shells and ssh.

Accepted: strict JSON; the same with its quotes stripped by a shell
(``{method:dflash,model:/m/d,num_speculative_tokens:15}``); YAML flow mappings
(``{method: dflash, model: /m/d}``); ``@path`` or a path ending in ``.json``,
``.yaml`` or ``.yml``. YAML is parsed with ``yaml.safe_load`` only.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

EXAMPLE = (
    '--speculative-config \'{"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16", '
    '"num_speculative_tokens": 15}\''
)
HELP_LINE = (
    "--speculative-config/-sc JSON | @file | file.json/.yaml, e.g. -sc "
    '\'{"method":"dflash","model":"z-lab/Qwen3-8B-DFlash-b16","num_speculative_tokens":15}\''
)
_FILE_SUFFIXES = (".json", ".yaml", ".yml")


class SpecConfigParseError(argparse.ArgumentTypeError):
    pass


def _error(value: str, why: str) -> SpecConfigParseError:
    return SpecConfigParseError(
        f"cannot parse {value!r} ({why}). If a shell or ssh stripped the quotes, "
        "write it as {method:dflash,model:/path/to/drafter,num_speculative_tokens:15} "
        f"or put it in a .json/.yaml file; example: {EXAMPLE}"
    )


def _scalar(text: str) -> Any:
    t = text.strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "\"'":
        return t[1:-1]
    low = t.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none", "~"):
        return None
    for cast in (int, float):
        try:
            return cast(t)
        except ValueError:
            pass
    return t


def _split_top(text: str, sep: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ValueError("unbalanced braces")
    parts.append("".join(cur))
    return parts


def _unquoted(text: str) -> Any:
    """JSON whose quotes were stripped: ``{a:b,c:{d:1},e:[1,2]}``."""
    t = text.strip()
    if t.startswith("{") and t.endswith("}"):
        body = t[1:-1].strip()
        out: dict[str, Any] = {}
        if not body:
            return out
        for item in _split_top(body, ","):
            if ":" not in item:
                raise ValueError(f"entry {item.strip()!r} has no ':'")
            key, val = item.split(":", 1)
            key = key.strip().strip("\"'")
            if not key:
                raise ValueError("empty key")
            out[key] = _unquoted(val)
        return out
    if t.startswith("[") and t.endswith("]"):
        body = t[1:-1].strip()
        return [_unquoted(x) for x in _split_top(body, ",")] if body else []
    return _scalar(t)


def _load_file(path: Path, value: str) -> dict:
    if not path.is_file():
        raise _error(value, f"file {str(path)!r} not found")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise _error(value, f"invalid JSON in {path}: {e}") from e
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise _error(
                value, f"invalid YAML in {path}: {e}".replace("\n", " ")
            ) from e
    if not isinstance(data, dict):
        raise _error(value, f"{path} does not hold a mapping")
    return data


def parse_speculative_config(value: str) -> dict:
    text = value.strip()
    if text.startswith("@"):
        return _load_file(Path(text[1:]).expanduser(), value)
    if text.lower().endswith(_FILE_SUFFIXES) and not text.startswith("{"):
        return _load_file(Path(text).expanduser(), value)
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if data is None and text.startswith("{"):
        try:
            # YAML flow mappings with spaces, then the quote-stripped form.
            data = _unquoted(re.sub(r":\s+", ":", text))
        except ValueError as e:
            raise _error(value, str(e)) from e
    if not isinstance(data, dict):
        raise _error(value, "expected a mapping such as {method:dflash,...}")
    return data
