# SPDX-License-Identifier: Apache-2.0
"""``layer_types`` / ``sliding_window`` of a DFlash drafter config (PR #40898)."""

from __future__ import annotations

from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"
ALLOWED = (FULL, SLIDING)


class DrafterConfigError(ValueError):
    """A DFlash drafter config field has a value vLLM cannot run."""


def resolve_layer_types(config: Any) -> tuple[list[str], int | None]:
    """Return (per-layer attention types, sliding window or None).

    ``layer_types`` absent means all full attention. Any sliding layer needs a
    positive ``sliding_window``.
    """
    n = int(config.num_hidden_layers)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [FULL] * n, None
    layer_types = list(layer_types)
    if len(layer_types) != n:
        raise DrafterConfigError(
            f"drafter config layer_types has {len(layer_types)} entries but "
            f"num_hidden_layers is {n}: give one of {list(ALLOWED)} per layer."
        )
    bad = sorted({t for t in layer_types if t not in ALLOWED})
    if bad:
        raise DrafterConfigError(
            f"drafter config layer_types contains {bad}: allowed values are "
            f"{list(ALLOWED)}; fix the drafter's config.json."
        )
    window = getattr(config, "sliding_window", None)
    if SLIDING in layer_types:
        if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
            raise DrafterConfigError(
                f"drafter config sliding_window={window!r} but layer_types has "
                f"sliding_attention layers: set sliding_window to a positive "
                f"integer (and use_sliding_window: true) in the drafter config."
            )
        return layer_types, window
    return layer_types, None
