# SPDX-License-Identifier: Apache-2.0
"""A byte-level BPE tokenizer over the tiny models' vocabulary, so that their
token ids spell text (JSON, regexes, grammars): what structured outputs need.

The tiny checkpoints ship a WordLevel tokenizer whose tokens are named
``<t17>``: no token spells ``{`` or ``"``, so a grammar cannot be followed.
:func:`with_text_tokenizer` makes a copy of a model directory (weights linked,
not copied) whose tokenizer maps the same ids to text instead:

* the special ids keep their names (``<pad> <bos> <eos> <mask>``, and any
  other special token of the source, e.g. the hybrid target's vision tokens);
* the next ids are the 95 printable ASCII characters, newline and tab;
* the remaining ids are two-letter tokens (``aa``, ``ab``, ...), with their
  BPE merges.

The weights are unchanged, so a model behaves token for token as before; only
the text of each token differs. Like GPT-2's, the tokenizer is byte-level
(``ByteLevel`` pre-tokenizer and decoder), which xgrammar and vLLM's other
structured-output backends read as such.
"""

from __future__ import annotations

import json
import shutil
import string
from itertools import product
from pathlib import Path

_WEIGHTS = (".safetensors", ".bin", ".pt")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def text_vocab(vocab_size: int, specials: dict[int, str]) -> tuple[dict, list]:
    """(vocab: byte-level string -> id, merges) over ``vocab_size`` ids."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's map

    b2u = bytes_to_unicode()
    chars = [b2u[ord(c)] for c in string.printable if c not in "\r\x0b\x0c"]
    pairs = ["".join(p) for p in product(string.ascii_lowercase, repeat=2)]
    free = [i for i in range(vocab_size) if i not in specials]
    if len(free) > len(chars) + len(pairs):
        raise ValueError(f"vocab_size {vocab_size} is larger than the text vocab")
    vocab = {name: i for i, name in specials.items()}
    merges = []
    for i, tok in zip(free, chars + pairs, strict=False):
        vocab[tok] = i
        if len(tok) == 2:
            merges.append(f"{tok[0]} {tok[1]}")
    return vocab, merges


def _specials(src: Path) -> dict[int, str]:
    tok = json.loads((src / "tokenizer.json").read_text())
    out = {t["id"]: t["content"] for t in tok.get("added_tokens", [])}
    for name, i in tok["model"]["vocab"].items():
        if name in ("<pad>", "<bos>", "<eos>", "<mask>"):
            out[i] = name
    return out


def _vocab_size(src: Path) -> int:
    cfg = json.loads((src / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["vocab_size"])


def write_text_tokenizer(src: Path, dst: Path) -> None:
    """Write ``dst/tokenizer.json`` and ``tokenizer_config.json``: the text
    tokenizer for ``src``'s vocabulary and special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = _specials(src)
    vocab, merges = text_vocab(_vocab_size(src), specials)
    tok = Tokenizer(
        models.BPE(
            vocab=vocab, merges=[tuple(m.split()) for m in merges], unk_token="<pad>"
        )
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(n, special=True) for n in specials.values()])
    tok.save(str(dst / "tokenizer.json"))
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.pop("added_tokens_decoder", None)
    cfg["chat_template"] = CHAT_TEMPLATE
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def with_text_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of model directory ``src`` at ``dst`` with the text tokenizer
    (weight files linked). Idempotent: an existing ``dst`` is rebuilt."""
    src, dst = Path(src).resolve(), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_dir():
            continue
        if f.name.endswith(_WEIGHTS):
            (dst / f.name).symlink_to(f)
        elif f.name not in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(f, dst / f.name)
    write_text_tokenizer(src, dst)
    return dst
