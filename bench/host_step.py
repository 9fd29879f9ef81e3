"""Host work per engine step that could grow with context: laid out from kept arrays vs
rebuilt from Python lists, side by side.

On a GPU a decode step of an 8B model at batch 256 takes ~12 ms of device time, and with
asynchronous output the host prepares the next step meanwhile: host work that grows with
prompt or output length (not with the step's new tokens) eats that budget. Two layouts the
engine keeps as int64 arrays per request, grown in place, are timed here against
rebuilding them from each request's lists every step, as the engine did before:

- ``block_tables``: the ``[B, blocks]`` table of a decode step (``Request.block_table_array``
  into ``ModelRunner.build_inputs``'s layout);
- ``penalty_ids``: the ``[B, output]`` ids a presence/frequency/repetition penalty counts
  (``sampler.OutputIds``); only the host layout is timed, not the device's counting.

    python -m bench.host_step --out bench/results/cpu/host_step.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.output import emit
from bench.provenance import git_state
from workers.engine.request import Request
from workers.engine.sampler import OutputIds
from workers.engine.sampling_params import SamplingParams


def _ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _layout(rows: list[Any], vocab: int) -> np.ndarray:
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), vocab, dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return ids


def block_tables(batch: int, blocks: int, repeats: int) -> dict[str, Any]:
    reqs = []
    for i in range(batch):
        r = Request(str(i), [1], SamplingParams())
        r.block_table = list(range(i * blocks, (i + 1) * blocks))
        r.block_table_array()
        reqs.append(r)

    def grow() -> None:  # a step: one block more for every 16th request, then the layout
        for r in reqs[::16]:
            r.block_table.append(0)
        _layout([r.block_table_array() for r in reqs], 0)

    lists = _ms(lambda: _layout([r.block_table for r in reqs], 0), repeats)
    arrays = _ms(grow, repeats)
    return {"batch": batch, "blocks_per_row": blocks, "from_lists_ms": round(lists, 3),
            "from_arrays_ms": round(arrays, 3), "ratio": round(lists / arrays, 1)}  # fmt: skip


def penalty_ids(batch: int, output: int, repeats: int) -> dict[str, Any]:
    vocab = 128_000
    outs = [[(i + 17 * k) % vocab for k in range(output)] for i in range(batch)]
    caches = []
    for o in outs:
        c = OutputIds([])
        c.extend(o)
        c.covered = len(o)
        caches.append(c)

    def rebuilt() -> None:  # as before: a tensor per row from its list, every step
        import torch

        ids = torch.full((batch, output + 1), vocab, dtype=torch.long)
        for i, o in enumerate(outs):
            ids[i, : len(o)] = torch.tensor(o, dtype=torch.long)

    def kept() -> None:  # a step: every row's new token copied, then the layout
        for c in caches:
            c.extend([5])
            c.covered += 1
        _layout([c.ids[: c.n] for c in caches], vocab)

    lists = _ms(rebuilt, repeats)
    arrays = _ms(kept, repeats)
    return {"batch": batch, "output_tokens": output, "from_lists_ms": round(lists, 3),
            "from_arrays_ms": round(arrays, 3), "ratio": round(lists / arrays, 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.host_step", description=__doc__.split("\n")[0]
    )
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path)
    ns = p.parse_args(argv)
    result = {
        "benchmark": "host_step",
        "git": git_state(),
        "block_tables": [block_tables(ns.batch, b, ns.repeats) for b in (32, 136, 512)],
        "penalty_ids": [penalty_ids(ns.batch, n, ns.repeats) for n in (256, 1024, 2048)],
    }
    emit(result, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
