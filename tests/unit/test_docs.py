# SPDX-License-Identifier: Apache-2.0
from pathlib import Path

from vllm_dflash.docs import patch_table


def test_readme_patch_table_is_generated_from_the_registry():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert patch_table() in readme, "regenerate: python -m vllm_dflash.docs"
