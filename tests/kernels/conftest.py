"""Kernel tests run the Triton kernels against the torch references.

Without CUDA they run in the Triton interpreter, which must be switched on before Triton is
first imported in the process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

# Triton reads the switch when it is first imported; imported earlier with it off, the
# interpreter fails with "Cannot call @triton.jit'd outside of the scope of a kernel".
_TRITON_IMPORTED_TOO_EARLY = (
    not torch.cuda.is_available()
    and "triton" in sys.modules
    and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Absolute and relative tolerance per output dtype. fp32 products are exact in the interpreter
# and 3-pass tf32 on GPU. bf16 outputs are rounded once (the interpreter truncates: up to one
# ulp, 2^-8 relative) on top of p being rounded to bf16 for the PV product. A wrong mask or a
# lost tile moves outputs by far more than this.
_TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 4e-3,
    torch.bfloat16: 1.6e-2,
}


@pytest.fixture(autouse=True)
def _interpreter_was_on_in_time() -> None:
    if _TRITON_IMPORTED_TOO_EARLY:
        pytest.fail(
            "triton was imported before tests/kernels/conftest.py turned TRITON_INTERPRET on; "
            "set TRITON_INTERPRET=1 in the environment (or in tests/conftest.py) on CPU machines"
        )


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def assert_close() -> Callable[[torch.Tensor, torch.Tensor], None]:
    """Compare a kernel's output with the reference at the tolerance of its dtype."""

    def check(got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.dtype == want.dtype
        tol = _TOLERANCES[want.dtype]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)

    return check


@dataclass
class PagedKV:
    """A random paged cache whose sequences own shuffled, non-contiguous blocks."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, unused entries hold -1
    context_lens: torch.Tensor  # [B] int32


MakePagedKV = Callable[..., PagedKV]


@pytest.fixture
def make_paged_kv(device: torch.device) -> MakePagedKV:
    """Build a cache of random K/V and give each sequence random, scattered blocks."""

    def make(
        lens: list[int],
        block_size: int,
        n_kv: int,
        head_dim: int,
        dtype: torch.dtype,
        spare_blocks: int = 3,
        seed: int = 0,
    ) -> PagedKV:
        gen = torch.Generator().manual_seed(seed)
        need = [(n + block_size - 1) // block_size for n in lens]
        num_blocks = sum(need) + spare_blocks
        shape = (num_blocks, block_size, n_kv, head_dim)
        k_cache = torch.randn(shape, generator=gen).to(dtype)
        v_cache = torch.randn(shape, generator=gen).to(dtype)
        ids = torch.randperm(num_blocks, generator=gen)
        width = max([*need, 1]) + 1  # one spare column: the kernels must not read past a length
        tables = torch.full((len(lens), width), -1, dtype=torch.int32)
        used = 0
        for b, n in enumerate(need):
            tables[b, :n] = ids[used : used + n].to(torch.int32)
            used += n
        return PagedKV(
            k_cache.to(device),
            v_cache.to(device),
            tables.to(device),
            torch.tensor(lens, dtype=torch.int32, device=device),
        )

    return make
