"""The engine on the Triton backend gives transformers' greedy tokens.

On CUDA the other tests already run the Triton kernels (``backend="auto"``). Without CUDA
the kernels run in the Triton interpreter, which must be on before Triton is first imported,
so this check runs in a fresh process: a small one in the default run, the full one
(four prompts, six tokens) with ``make test-slow``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import sys
from tests.engine.tiny_checkpoints import checkpoint, hf_greedy, prompts
from workers.engine import LLM, SamplingParams

path = checkpoint("llama", sys.argv[1])
policies, n_prompts, max_tokens = sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4])
batch = [p for p in prompts(4) if len(p) > 1][-n_prompts:]
for policy in policies:
    llm = LLM(str(path), backend="triton", dtype="float32", block_size=4, num_kv_blocks=64,
              policy=policy, max_num_batched_tokens=8, max_batch_size=4)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs = llm.generate(prompt_token_ids=batch, sampling_params=params)
    for o, p in zip(outs, batch):
        assert o.token_ids == hf_greedy(path, p, max_tokens), (policy, p, o.token_ids)
print("OK")
"""


def _run(tmp_path: Path, policies: str, n_prompts: int, max_tokens: int) -> None:
    import torch

    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), policies, str(n_prompts), str(max_tokens)],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]


def test_triton_backend_gives_transformers_tokens_end_to_end(tmp_path: Path) -> None:
    """The default run's check, small enough for the interpreter (~10 s): prompts of 4, 5
    and 14 tokens under hybrid (the long one's varlen prefill chunked at 8 tokens beside
    decodes) and continuous, through the store, split-KV decode, fused norm/RoPE/SiLU and
    sampling kernels."""
    _run(tmp_path, "hybrid,continuous", 3, 4)


@pytest.mark.slow
def test_triton_backend_matches_transformers(tmp_path: Path) -> None:
    _run(tmp_path, "hybrid,continuous", 4, 6)
