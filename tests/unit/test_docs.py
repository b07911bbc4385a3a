# SPDX-License-Identifier: Apache-2.0
from pathlib import Path

from vllm_dflash.docs import matrix_table, patch_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_patch_table_is_generated_from_the_registry():
    assert patch_table() in README.read_text(), (
        "regenerate: python -m vllm_dflash.docs --write"
    )


def test_readme_matrix_table_is_generated_from_ci_matrix():
    assert matrix_table() in README.read_text(), (
        "regenerate: python -m vllm_dflash.docs --write"
    )
