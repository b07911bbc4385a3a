# SPDX-License-Identifier: Apache-2.0
"""#40898 proposer logic: per-layer causal/non-causal metadata over several groups."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_dflash.spec_decode.dflash_proposer import DFlashSWAProposer


class _Builder:
    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.calls: list[bool] = []
        self.kv_cache_spec = "spec"

    def build_for_drafting(self, common_attn_metadata, draft_index=0):
        self.calls.append(common_attn_metadata.causal)
        return SimpleNamespace(causal=common_attn_metadata.causal, tag=self.tag)


class _Group:
    def __init__(self, backend: str, layers: list[str]) -> None:
        self.backend = SimpleNamespace(
            get_name=lambda: backend,
            get_builder_cls=lambda: (
                lambda spec, names, cfg, dev: _Builder("own:" + ",".join(names))
            ),
        )
        self.layer_names = layers
        self.builder = _Builder(backend + ":" + ",".join(layers))

    def get_metadata_builder(self):
        return self.builder


def _proposer(groups, sliding) -> DFlashSWAProposer:
    p = object.__new__(DFlashSWAProposer)
    p.draft_attn_groups = groups
    p.sliding_attn_layer_names = frozenset(sliding)
    p.vllm_config, p.device = None, None
    return p


def _cad():
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    z = torch.zeros(2, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=z, query_start_loc_cpu=z, seq_lens=z[:1], num_reqs=1,
        num_actual_tokens=1, max_query_len=1, max_seq_len=1,
        block_table_tensor=z.view(1, 2), slot_mapping=z.long(), causal=False,
    )  # fmt: skip


def test_sliding_layers_get_causal_metadata_across_groups():
    g1 = _Group("FLASH_ATTN", ["d.0", "d.1"])
    g2 = _Group("FLASH_ATTN", ["d.2", "d.3", "d.4"])
    p = _proposer([g1, g2], sliding={"d.0", "d.2", "d.3"})
    per_group, per_layer = p.build_per_group_and_layer_attn_metadata(_cad())
    assert len(per_group) == 2
    assert {n: md.causal for n, md in per_layer.items()} == {
        "d.0": True, "d.1": False, "d.2": True, "d.3": True, "d.4": False,
    }  # fmt: skip
    assert g1.builder.calls == [False, True] and g2.builder.calls == [False, True]


def test_dense_drafter_builds_once_per_group():
    g = _Group("CPU_ATTN", ["d.0", "d.1"])
    _, per_layer = _proposer([g], sliding=()).build_per_group_and_layer_attn_metadata(
        _cad()
    )
    assert all(md.causal is False for md in per_layer.values()) and g.builder.calls == [
        False
    ]


def test_unverified_backend_fails_at_startup_naming_one_that_works(monkeypatch):
    from vllm.v1.spec_decode.dflash import DFlashProposer

    monkeypatch.setattr(
        DFlashProposer, "initialize_attn_backend", lambda self, *a, **k: None
    )
    p = _proposer([_Group("TRITON_ATTN", ["d.0"])], sliding=())
    with pytest.raises(ValueError, match="TRITON_ATTN.*--attention-backend FLASH_ATTN"):
        p.initialize_attn_backend(None)


@pytest.mark.parametrize(
    "backend, sliding, ok",
    [
        ("FLEX_ATTENTION", (), True),  # fp32 on CUDA
        ("FLEX_ATTENTION", ("d.0",), True),  # with a builder of their own (below)
        ("FLASH_ATTN", ("d.0",), True),
        ("CPU_ATTN", ("d.0",), True),
        ("TRITON_ATTN", ("d.0",), False),
    ],
)
def test_sliding_layers_need_a_backend_verified_for_windows(
    monkeypatch, backend, sliding, ok
):
    from vllm.v1.spec_decode.dflash import DFlashProposer

    monkeypatch.setattr(
        DFlashProposer, "initialize_attn_backend", lambda self, *a, **k: None
    )
    p = _proposer([_Group(backend, ["d.0", "d.1"])], sliding=sliding)
    if ok:
        p.initialize_attn_backend(None)
    else:
        with pytest.raises(ValueError, match="sliding-window layers.*FLASH_ATTN"):
            p.initialize_attn_backend(None)


@pytest.mark.parametrize("backend", ["FLEX_ATTENTION", "FLASH_ATTN", "CPU_ATTN"])
def test_sliding_layers_get_a_builder_of_their_own(monkeypatch, backend):
    """FLEX_ATTENTION block masks point into their builder's buffers: a sliding
    layer's (window-pruned) mask must not share them with the full layers'."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    monkeypatch.setattr(
        DFlashProposer, "initialize_attn_backend", lambda self, *a, **k: None
    )
    g = _Group(backend, ["d.0", "d.1", "d.2"])
    p = _proposer([g], sliding={"d.0", "d.1"})
    p.initialize_attn_backend(None)
    _, per_layer = p.build_per_group_and_layer_attn_metadata(_cad())
    tags = {n: md.tag for n, md in per_layer.items()}
    assert tags == {"d.0": "own:d.0,d.1", "d.1": "own:d.0,d.1", "d.2": g.builder.tag}
    assert g.builder.calls == [False]
    assert p.sliding_builders[0].calls == [True]
