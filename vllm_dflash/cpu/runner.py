# SPDX-License-Identifier: Apache-2.0
"""CPU defect 1: ``CPUModelRunner.load_model`` never sets the aux hidden-state layers.

The GPU runner calls ``model.set_aux_hidden_state_layers(...)`` after loading when
EAGLE-3/DFlash need intermediate target features; the CPU runner does not, so the
target returns a plain tensor and the profile run dies unpacking it.
"""

from vllm_dflash.registry import (
    CPU_ONLY,
    V020,
    Patch,
    PatchKind,
    code_reads,
    original,
    replace_attr,
)

NAME = "cpu_aux_hidden_state_layers"


def probe() -> bool:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    # Does the CPU runner's load_model call set_aux_hidden_state_layers?
    return not code_reads(CPUModelRunner.load_model, "set_aux_hidden_state_layers")


def apply() -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    stock_load_model = original(CPUModelRunner.load_model)

    def load_model(self, load_dummy_weights: bool = False) -> None:
        stock_load_model(self, load_dummy_weights=load_dummy_weights)
        if getattr(self, "use_aux_hidden_state_outputs", False):
            # Same selection as GPUModelRunner.load_model (and so the same
            # #40727 shift when that backport is active).
            aux_layers = self._get_eagle3_aux_layers_from_config()
            if not aux_layers:
                aux_layers = self.model.get_eagle3_default_aux_hidden_state_layers()
            self.model.set_aux_hidden_state_layers(aux_layers)

    replace_attr(CPUModelRunner, "load_model", load_model, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.CPU,
    targets=("vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model",),
    summary="CPU runner sets the target's aux hidden-state layers after loading.",
    why="EAGLE-3/DFlash die in the CPU profile run ('too many values to unpack').",
    upstream="none, CPU backend defect",
    versions=V020,
    platforms=CPU_ONLY,
    probe=probe,
    apply=apply,
    future="Send upstream as a CPU runner fix.",
)
