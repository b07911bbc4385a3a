# SPDX-License-Identifier: Apache-2.0
"""DFlash drafter config checks (one-line errors before weights load)."""
