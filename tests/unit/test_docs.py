# SPDX-License-Identifier: Apache-2.0
from vllm_dflash.docs import MATRIX_DOC, PATCHES_DOC, matrix_table, patch_table


def test_patch_table_is_generated_from_the_registry():
    assert patch_table() in PATCHES_DOC.read_text(), (
        "regenerate: python -m vllm_dflash.docs --write"
    )


def test_matrix_table_is_generated_from_ci_matrix():
    assert matrix_table() in MATRIX_DOC.read_text(), (
        "regenerate: python -m vllm_dflash.docs --write"
    )
