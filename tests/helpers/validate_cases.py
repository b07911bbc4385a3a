# SPDX-License-Identifier: Apache-2.0
"""Build vllm.LLM with each broken drafter; print {case: error line} as JSON."""

import json
import sys
from pathlib import Path

from tests.helpers.bad_drafters import CASES, make

# Bad speculative-config keys with a good drafter: extra keys, expected words.
SPEC_CASES = {
    "draft_length_value": (
        {"draft_length": "bogus"},
        "draft_length='bogus' is not allowed",
    ),
}
# Engine arguments a good DFlash config cannot run with (k = 3): LLM kwargs,
# expected words.
ENGINE_CASES = {
    "step_budget": (
        {"max_num_seqs": 64, "max_num_batched_tokens": 128},
        "max_num_batched_tokens=128 is too small for DFlash with max_num_seqs=64",
    ),
}


def main() -> None:
    target, dense, workdir = (Path(a) for a in sys.argv[1:4])
    from vllm import LLM

    results = {}
    cases = {name: (edits, k, {}, {}) for name, (edits, k, _) in CASES.items()}
    cases |= {name: ({}, 3, extra, {}) for name, (extra, _) in SPEC_CASES.items()}
    cases |= {name: ({}, 3, {}, kw) for name, (kw, _) in ENGINE_CASES.items()}
    for name, (edits, k, extra, engine_kwargs) in cases.items():
        drafter = make(dense, workdir / name, edits)
        try:
            LLM(
                model=str(target),
                speculative_config={
                    "method": "dflash",
                    "model": str(drafter),
                    "num_speculative_tokens": k,
                    **extra,
                },
                dtype="float32",
                max_model_len=512,
                enforce_eager=True,
                **engine_kwargs,
            )
            results[name] = {"error": None}
        except Exception as e:  # what a user would see
            results[name] = {"type": type(e).__name__, "error": str(e)}
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
