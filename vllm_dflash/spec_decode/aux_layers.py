# SPDX-License-Identifier: Apache-2.0
"""Backport of vLLM PR #40727: DFlash target-layer indexing is off by one.

DFlash ``target_layer_ids`` are 0-based decoder layers whose OUTPUT feeds the
drafter (HF ``hidden_states[id + 1]``). vLLM's aux capture index ``i`` means
"after layer i-1" (0 is the embedding output), and 0.20.x passes the ids
unshifted, so every feature comes from one layer too early. For method dflash
the capture indices become ``id + 1``. Both runners use
``GPUModelRunner._get_eagle3_aux_layers_from_config`` (the CPU runner through
``cpu_aux_hidden_state_layers``), and speculators-format configs land in the
same fields, so this one symbol covers all three paths.
"""

from types import SimpleNamespace

from vllm_dflash.registry import (
    ALL_PLATFORMS,
    V020,
    Patch,
    PatchKind,
    original,
    replace_attr,
)

NAME = "dflash_aux_layer_shift"


def _fake_runner(layer_ids: list[int]) -> SimpleNamespace:
    hf_config = SimpleNamespace(dflash_config={"target_layer_ids": layer_ids})
    spec = SimpleNamespace(
        method="dflash",
        draft_model_config=SimpleNamespace(hf_config=hf_config),
        use_dflash=lambda: True,
    )
    return SimpleNamespace(speculative_config=spec)


def probe() -> bool:
    """Ask the running vLLM which capture indices it uses for ids [0, 2]."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    got = original(GPUModelRunner._get_eagle3_aux_layers_from_config)(
        _fake_runner([0, 2])
    )
    if got is None or tuple(got) not in ((0, 2), (1, 3)):
        raise RuntimeError(f"unexpected aux layers {got!r} for target ids [0, 2]")
    return tuple(got) == (0, 2)  # unshifted: still needs the backport


def apply() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock = original(GPUModelRunner._get_eagle3_aux_layers_from_config)

    def _get_eagle3_aux_layers_from_config(self) -> tuple[int, ...] | None:
        layer_ids = stock(self)
        spec = self.speculative_config
        if layer_ids and spec is not None and spec.method == "dflash":
            return tuple(i + 1 for i in layer_ids)
        return layer_ids

    replace_attr(
        GPUModelRunner,
        "_get_eagle3_aux_layers_from_config",
        _get_eagle3_aux_layers_from_config,
        NAME,
    )


PATCH = Patch(
    name=NAME,
    kind=PatchKind.BACKPORT,
    targets=(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_eagle3_aux_layers_from_config",
    ),
    summary="DFlash target_layer_ids map to vLLM capture index id+1 (after layer id).",
    why="0.20.x captures every DFlash feature one layer too early: lower acceptance.",
    upstream="vllm-project/vllm#40727 (released in 0.22.0)",
    versions=V020,
    platforms=ALL_PLATFORMS,
    probe=probe,
    apply=apply,
    future="Drop when the oldest supported vLLM is 0.22.0; the probe already skips it there.",
)
