"""The engine on the Triton backend gives transformers' greedy tokens.

On CUDA the other tests already run the Triton kernels (``backend="auto"``). Without CUDA
the kernels run in the Triton interpreter, which must be on before Triton is first imported,
so this check runs in a fresh process. Slow in the interpreter: ``make test-slow``.
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
batch = prompts(4)
for policy in ("hybrid", "continuous"):
    llm = LLM(str(path), backend="triton", dtype="float32", block_size=4, num_kv_blocks=64,
              policy=policy, max_num_batched_tokens=8, max_batch_size=4)
    outs = llm.generate(prompt_token_ids=batch, sampling_params=SamplingParams(temperature=0, max_tokens=6))
    for o, p in zip(outs, batch):
        assert o.token_ids == hf_greedy(path, p, 6), (policy, p, o.token_ids)
print("OK")
"""


@pytest.mark.slow
def test_triton_backend_matches_transformers(tmp_path: Path) -> None:
    import torch

    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]
