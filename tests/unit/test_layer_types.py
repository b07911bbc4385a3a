# SPDX-License-Identifier: Apache-2.0
from types import SimpleNamespace

import pytest

from vllm_dflash.config.layer_types import DrafterConfigError, resolve_layer_types


def cfg(**kw):
    return SimpleNamespace(num_hidden_layers=3, **kw)


def test_absent_means_all_full():
    assert resolve_layer_types(cfg()) == (["full_attention"] * 3, None)


def test_mixed_with_window():
    lt = ["sliding_attention", "sliding_attention", "full_attention"]
    assert resolve_layer_types(cfg(layer_types=lt, sliding_window=6)) == (lt, 6)


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(layer_types=["full_attention"]),
            "has 1 entries but num_hidden_layers is 3",
        ),
        (
            dict(layer_types=["full_attention", "linear", "full_attention"]),
            "contains \\['linear'\\]",
        ),
        (
            dict(layer_types=["sliding_attention"] * 3, sliding_window=None),
            "sliding_window=None",
        ),
        (
            dict(layer_types=["sliding_attention"] * 3, sliding_window=0),
            "sliding_window=0",
        ),
    ],
)
def test_errors_name_field_and_fix(kw, match):
    with pytest.raises(DrafterConfigError, match=match):
        resolve_layer_types(cfg(**kw))
