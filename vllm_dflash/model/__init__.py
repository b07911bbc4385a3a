# SPDX-License-Identifier: Apache-2.0
"""The DFlash drafter model class registered for ``DFlashDraftModel``."""
