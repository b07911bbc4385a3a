# SPDX-License-Identifier: Apache-2.0
"""Deterministic small test images (no files, no downloads) and image prompts."""

from __future__ import annotations

from vllm_dflash.testing.tiny_hybrid import IMAGE_ID, VISION_END_ID, VISION_START_ID


def make_image(width: int, height: int, seed: int):
    """An RGB PIL image of uniform noise, the same for the same arguments."""
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3))
    return Image.fromarray(pixels.astype("uint8"), "RGB")


def image_placeholder() -> list[int]:
    """What a prompt holds where an image goes; vLLM's Qwen3.5 processor expands
    the single ``<|image_pad|>`` to one token per merged patch."""
    return [VISION_START_ID, IMAGE_ID, VISION_END_ID]
