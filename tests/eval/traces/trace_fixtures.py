"""Shared helpers of the trace-loader tests (tests/eval/traces/test_traces*.py): where the public
traces are, skipping a test when one is absent, and hand-made trace lines. Not a test module."""

from __future__ import annotations

import json
import pathlib

import pytest

from eval.paper_setup import DEFAULT_TRACES_DIR

# The public traces live beside the repository (../shared/traces); VERTUMNUS_TRACES_DIR points
# elsewhere for a checkout that is not laid out that way (`eval.paper_setup`).
TRACES = pathlib.Path(DEFAULT_TRACES_DIR)
CONV = TRACES / "mooncake" / "conversation_trace.jsonl"
SYNTH = TRACES / "mooncake" / "synthetic_trace.jsonl"
AZURE = TRACES / "azure2023" / "AzureLLMInferenceTrace_code.csv"
LEVAL = TRACES / "leval" / "leval_requests_llama3tok.csv"

# A valid Mooncake row; the CSV headers of the Azure and L-Eval formats.
GOOD = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
AZ_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
LV_HEAD = "task,doc_id,doc_tokens,instr_tokens,input_tokens,ref_output_tokens\n"


def need(path: pathlib.Path) -> None:
    """Skips the calling test when the shared trace `path` is absent."""
    if not path.exists():
        pytest.skip(f"shared trace {path} not present: set VERTUMNUS_TRACES_DIR to the folder "
                    f"holding the public traces (mooncake/, azure2023/, leval/, agent_sessions/; "
                    f"their sources are listed in that folder's README.md), default "
                    f"../shared/traces")


def common_prefix(a, b) -> int:
    """Length of the common leading run of sequences `a` and `b`."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def mooncake_line(ts, n=600) -> str:
    """One Mooncake JSON line: `GOOD` at timestamp `ts` (ms) with input length `n` tokens."""
    return json.dumps({**GOOD, "timestamp": ts, "input_length": n})
