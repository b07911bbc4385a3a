# SPDX-License-Identifier: Apache-2.0
"""Parsing of ``--speculative-config`` values that survive shells and ssh.

Accepted values: strict JSON; the same with its quotes stripped by a shell
(``{method:dflash,model:/m/d,num_speculative_tokens:15}``); YAML flow mappings
(``{method: dflash, model: /m/d}``); ``@path`` or a path ending in ``.json``,
``.yaml`` or ``.yml``. YAML is parsed with ``yaml.safe_load`` only.

:func:`rebuild_split_config` repairs argv in which bash already took such a
value apart (word splitting at spaces, brace expansion at commas); see
``vllm_dflash/entrypoints/argv_rebuild.py`` for where it runs.

Error messages recommend only forms that reach vLLM unchanged through bash and
ssh as typed: vLLM's dotted form, a file, or quoted JSON.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
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


# Forms that bash and ssh pass through unchanged (no braces, commas or spaces
# left for a shell to take apart, or quoted once).
HOW_TO_FIX = (
    "If a shell or ssh stripped the quotes, use vLLM's dotted form "
    "(--speculative-config.method dflash --speculative-config.model /path/to/drafter "
    "--speculative-config.num_speculative_tokens 15), a file (-sc @spec.json or "
    "-sc spec.yaml), or quoted JSON; example: " + EXAMPLE
)


class SpecConfigParseError(argparse.ArgumentTypeError):
    pass


def _error(value: str, why: str) -> SpecConfigParseError:
    return SpecConfigParseError(f"cannot parse {value!r} ({why}). {HOW_TO_FIX}")


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
        raise _error(value, "expected a mapping (JSON object) of fields")
    return data


# --- argv that a shell already took apart -------------------------------------

FLAGS = ("--speculative-config", "--speculative_config", "-sc")


class ShellSplitError(ValueError):
    """The words after --speculative-config cannot be put back together."""


@dataclass(frozen=True)
class Rebuilt:
    flag: str
    words: tuple[str, ...]  # the flag and its value, as the shell delivered them
    config: dict[str, Any]


def _depth(text: str) -> int:
    return sum(text.count(c) for c in "{[") - sum(text.count(c) for c in "}]")


def _is_option(word: str) -> bool:
    """``--x`` or ``-x`` (a negative number such as ``-1}`` is a value)."""
    return word.startswith("--") or (
        len(word) > 1 and word[0] == "-" and word[1].isalpha()
    )


def _field_item(word: str, fields: Collection[str]) -> bool:
    key, sep, _ = word.partition(":")
    return bool(sep) and key in fields


def _from_expanded(words: Sequence[str]) -> dict[str, Any]:
    """Invert bash brace expansion of quote-stripped JSON.

    ``{"a":1,"b":{"c":2,"d":[3,4]}}`` reaches argv as ``a:1 b:c:2 b:d:[3 b:4]``:
    each top-level entry is a word, a nested mapping repeats its key as a prefix
    (keys are unique in a mapping, so a repeated key means nesting) and the
    commas of a list split it into words.
    """
    groups: list[tuple[str, list[str]]] = []
    for word in words:
        if groups and word.startswith(groups[-1][0] + ":"):
            groups[-1][1].append(word[len(groups[-1][0]) + 1 :])
        elif groups and len(groups[-1][1]) == 1 and _depth(groups[-1][1][0]) > 0:
            groups[-1][1][0] += "," + word  # the rest of a list (or mapping)
        else:
            key, sep, rest = word.partition(":")
            if not sep or not key.strip():
                raise ShellSplitError(f"word {word!r} is not key:value")
            groups.append((key, [rest]))
    out: dict[str, Any] = {}
    for key, rests in groups:
        if len(rests) > 1:
            out[key] = _from_expanded(rests)
            continue
        if _depth(rests[0]) != 0:
            raise ShellSplitError(f"unbalanced brackets in {key}:{rests[0]}")
        try:
            out[key] = _unquoted(rests[0])
        except ValueError as e:
            raise ShellSplitError(f"{key}:{rests[0]}: {e}") from e
    return out


def _split_value(
    argv: Sequence[str],
    j: int,
    first: str,
    flag: str,
    prefix: str,
    fields: Collection[str],
) -> tuple[int, dict[str, Any]] | None:
    """How many argv words from ``j`` on continue the value that begins with
    ``first``, and its mapping; None if ``first`` is not a mangled mapping.
    ``prefix`` is what bash repeated on every word (``--speculative-config=``)."""
    words = [first]
    if first.startswith("{") and _depth(first) > 0:
        # Word splitting: '{method: dflash, ...}' -> '{method:' 'dflash,' ...
        while _depth(" ".join(words)) > 0:
            if j + len(words) - 1 >= len(argv) or _is_option(argv[j + len(words) - 1]):
                n = j + len(words) - 1
                stop = f"the next word is {argv[n]!r}" if n < len(argv) else "argv ends"
                raise ShellSplitError(
                    f"value {' '.join(words)!r} opens more braces than it closes "
                    f"and {stop}"
                )
            words.append(argv[j + len(words) - 1])
        try:
            return len(words) - 1, parse_speculative_config(" ".join(words))
        except SpecConfigParseError as e:
            raise ShellSplitError(str(e).split(". If a shell")[0]) from e
    if not _field_item(first, fields):
        return None
    # Brace expansion: '{"method":"dflash","model":"/m"}' -> 'method:dflash' 'model:/m'.
    for word in argv[j:]:
        if not word.startswith(prefix):
            break
        word = word[len(prefix) :]
        if _depth(",".join(words)) > 0:  # the rest of a list split at its commas
            if _is_option(word):
                break
        elif not _field_item(word, fields):
            break
        words.append(word)
    return len(words) - 1, _from_expanded(words)


def rebuild_split_config(
    argv: Sequence[str], fields: Collection[str]
) -> tuple[list[str], list[Rebuilt]]:
    """Put a ``--speculative-config`` value that bash took apart back into one word.

    ``fields`` are the names of vLLM's SpeculativeConfig fields: after a
    brace-expanded ``key:value`` word only further ``field:value`` words (and the
    rest of an open list) are taken, so an option or the model tag is never
    swallowed; a word-split ``{...`` value takes words until its braces close and
    never an option. Returns the new argv (the value as strict JSON) and what
    was rebuilt; raises :class:`ShellSplitError` (one line) if the words do not
    form a mapping.
    """
    out: list[str] = []
    rebuilt: list[Rebuilt] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        flag, eq, inline = word.partition("=")
        if flag not in FLAGS or (not eq and i + 1 >= len(argv)):
            out.append(word)
            i += 1
            continue
        # '--speculative-config={"a":1,"b":2}' expands to '--speculative-config=a:1'
        # '--speculative-config=b:2': every continuation word carries the prefix.
        first, j, prefix = (
            (inline, i + 1, flag + "=") if eq else (argv[i + 1], i + 2, "")
        )
        try:
            found = _split_value(argv, j, first, flag, prefix, fields)
        except ShellSplitError as e:
            raise ShellSplitError(f"argument {flag}: {e}. {HOW_TO_FIX}") from e
        if found is None:
            out.append(word)
            i += 1
            continue
        more, config = found
        out += [flag, json.dumps(config)]
        rebuilt.append(Rebuilt(flag, tuple(argv[i : j + more]), config))
        i = j + more
    return out, rebuilt
