# SPDX-License-Identifier: Apache-2.0
"""Runtime patches of vLLM, declared in one registry (see ``catalog``)."""
