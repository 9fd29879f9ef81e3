"""Train ``pystd-tiny``, the project's demo model: a tiny Llama trained on Python's own stdlib.

The model exists so that the serving stack (engine, kernels, gateway, benchmarks) has a real
checkpoint with *confident* outputs that runs anywhere: it is small enough to commit (< 20 MB),
trains on 2 CPU cores in about 25 minutes (~50 passes over its data: loss 0.03), and needs no
data beyond what ships with Python and one file of this repository:

* code: the stdlib sources (``Lib/*.py`` plus a few packages), split at top-level statements so
  that a training window usually starts with ``<|bos|>`` followed by ``def``/``class``/``import``,
  just like a serving prompt does; ``--code-docs`` short documents (up to ``--max-doc-chars``)
  are kept, so that the time budget covers the corpus 10+ times (memorised idioms are what make
  the outputs confident);
* docs: the ``pydoc_data.topics`` help texts, cut to the same length;
* chat: a few hundred deterministic question/answer pairs mined from docstrings with ``ast``
  ("What does the function `json.dumps` do?" -> first docstring sentence, "Which module defines
  `OrderedDict`?" -> "collections"), rendered with the chat template and replayed for many epochs
  so that the chat endpoint answers them verbatim.  They are also written to
  ``bench/data/stdlib_qa.jsonl`` for golden sets;
* topics: ``bench/data/domain_notes.jsonl``, a two-sentence note on each everyday topic of the
  golden set (``bench/golden_templates.py``: finance, medical, legal, ...), taught as the answer
  under the question forms the golden set does not ask (:func:`domain_qa`). Without them all
  but the golden set's stdlib questions were out of domain: the model answered with near-ties,
  and issue #5's KV quantisation bar measured those ties rather than what quantising loses.

The output folder is a standard Hugging Face Llama checkpoint (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``)
plus ``TRAINING.md``.  The end of the run checks that ``transformers`` loads and generates from it,
that ``tokenizers`` + ``jinja2`` reproduce the chat template exactly, and that a plain-torch Llama
forward (no ``transformers``) matches the ``transformers`` logits.

Run from the repository root::

    python -m bench.train_tiny                       # the committed run (defaults)
    python -m bench.train_tiny --time-limit-s 600    # a quick, less confident model
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import itertools
import json
import math
import os
import random
import re
import shlex
import sys
import sysconfig
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# libgomp reads this when torch loads.  On a CPU shared with other jobs, spinning OpenMP workers
# wait on a descheduled sibling and a 2-thread step runs 2-3x slower; passive waiting avoids it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "models" / "pystd-tiny"
DEFAULT_QA_OUT = BENCH_DIR / "data" / "stdlib_qa.jsonl"
DEFAULT_NOTES = BENCH_DIR / "data" / "domain_notes.jsonl"

# Ids follow list order, so bos=0, eos=1, pad=2 in every build.
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]
BOS, EOS, PAD = SPECIAL_TOKENS[:3]

# One line on purpose: with no newline after a block tag, HF's trim_blocks/lstrip_blocks and a
# plain jinja2.Template render byte-identical text.  Each turn ends with eos, so eos is the only
# stop token a server needs.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
SYSTEM_PROMPT = "You answer questions about the Python standard library."

# Packages whose modules join the top-level Lib/*.py files (code corpus and Q/A).
EXTRA_PACKAGES = [
    "collections",
    "concurrent/futures",
    "html",
    "http",
    "json",
    "logging",
    "re",
    "urllib",
]

# Data tables and build artefacts, not code anyone writes: they would only teach the model to
# emit entity or config tables.
SKIP_MODULES = ("html.entities", "_sysconfigdata", "this", "antigravity")

# Asked about first, with every question they yield: the APIs people actually ask about.
FEATURED_MODULES = [
    "json",
    "collections",
    "os",
    "re",
    "pathlib",
    "shutil",
    "subprocess",
    "logging",
    "argparse",
    "datetime",
    "random",
    "functools",
    "typing",
    "dataclasses",
    "textwrap",
    "string",
    "csv",
    "copy",
    "heapq",
    "glob",
    "tempfile",
    "threading",
    "contextlib",
    "enum",
    "inspect",
    "base64",
    "statistics",
    "urllib.parse",
]

# Coarse module groups for the Q/A ``domain`` field ("group: modules"); others are "misc".
DOMAIN_TABLE = """
text: codecs difflib gettext html locale re shlex string stringprep textwrap
data: base64 bisect collections copy copyreg configparser csv dataclasses enum heapq json pickle
data: pickletools plistlib pprint quopri reprlib shelve struct tomllib uu xdrlib
files: bz2 filecmp fileinput fnmatch genericpath glob gzip io linecache lzma ntpath os pathlib
files: posixpath shutil stat tarfile tempfile zipapp zipfile
numeric: colorsys decimal fractions numbers random statistics
time: calendar datetime sched zoneinfo
concurrency: asyncio concurrent multiprocessing queue selectors subprocess threading
net: cgi cgitb ftplib http imaplib ipaddress mailbox mailcap mimetypes nntplib poplib smtplib
net: socket socketserver ssl telnetlib urllib uuid webbrowser
dev: abc argparse ast bdb cProfile cmd code codeop compileall contextlib dis doctest functools
dev: getopt getpass importlib inspect keyword logging modulefinder operator optparse pdb pkgutil
dev: profile pstats py_compile pyclbr pydoc runpy site sysconfig timeit token tokenize trace
dev: traceback tracemalloc types typing unittest warnings weakref
"""
MODULE_DOMAIN = {
    mod: group.strip()
    for group, mods in (line.split(":") for line in DOMAIN_TABLE.strip().splitlines())
    for mod in mods.split()
}


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; defaults are the committed run."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2400, help="planned optimizer steps")
    p.add_argument("--seq-len", type=int, default=1024, help="training window, tokens")
    p.add_argument("--batch-size", type=int, default=2, help="windows per step")
    p.add_argument(
        "--time-limit-s",
        type=float,
        default=0.0,
        help="wall-clock budget for the whole script (0 = none); training stops early, "
        "decays the learning rate in time and still saves and verifies",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output model folder")
    p.add_argument("--qa-out", type=Path, default=DEFAULT_QA_OUT, help="Q/A jsonl path")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    p.add_argument("--decay-frac", type=float, default=0.3, help="final linear-decay share")
    p.add_argument("--chat-frac", type=float, default=0.5, help="share of chat windows")
    p.add_argument("--max-qa", type=int, default=300, help="Q/A pairs to mine")
    p.add_argument(
        "--domain-notes",
        type=Path,
        default=DEFAULT_NOTES,
        help="two-sentence notes on the golden set's everyday topics (jsonl), taught as chat "
        "answers under the question forms the golden set does not ask",
    )
    p.add_argument(
        "--max-doc-chars",
        type=int,
        default=300,
        help="leave out longer code documents (and cut topics): a smaller corpus is seen for "
        "several epochs in the time budget, which is what makes the outputs confident",
    )
    p.add_argument(
        "--code-docs",
        type=int,
        default=1000,
        help="code documents kept: every import block plus an even spread of the rest",
    )
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=640)
    p.add_argument("--max-positions", type=int, default=2048)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------
# Corpus: stdlib sources, pydoc topics
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceFile:
    """One stdlib module: dotted name, path relative to the stdlib root, text, parsed tree."""

    module: str
    relpath: str
    text: str
    tree: ast.Module | None


def stdlib_root() -> Path:
    """The running interpreter's ``Lib`` directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def load_sources(root: Path) -> list[SourceFile]:
    """Read ``Lib/*.py`` and ``EXTRA_PACKAGES`` in sorted (deterministic) order."""
    paths = sorted(root.glob("*.py"))
    for pkg in EXTRA_PACKAGES:
        paths += sorted((root / pkg).glob("*.py"))
    files = []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        parts = rel[: -len(".py")].split("/")
        if parts[-1] == "__init__":
            parts.pop()
        if ".".join(parts).startswith(SKIP_MODULES):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree: ast.Module | None = ast.parse(text)
        except SyntaxError:  # a file for another Python version: still good text
            tree = None
        files.append(SourceFile(".".join(parts), rel, text, tree))
    return files


def _block_starts(nodes: list[ast.stmt], lines: list[str]) -> list[int]:
    """0-based first lines of the def/class blocks among ``nodes``, decorators and comments
    just above included."""
    starts = []
    for node in nodes:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            while first > 0 and lines[first - 1].lstrip().startswith("#"):
                first -= 1
            starts.append(first)
    return starts


def _cut(lines: list[str], cuts: list[int]) -> list[str]:
    """Join ``lines`` between successive cut points into non-blank documents."""
    docs = ["".join(lines[a:b]).strip("\n") + "\n" for a, b in itertools.pairwise(cuts)]
    return [d for d in docs if d.strip()]


def split_top_level(src: SourceFile, max_chars: int) -> list[str]:
    """Split a module into documents: docstring, header (imports, constants), each def/class.

    Why: every training window starts at a document start, right after ``<|bos|>``, which is
    exactly what a prompt such as ``class `` or ``import os`` looks like at serving time.  A
    class longer than ``max_chars`` is split further at its methods (indented, as in the file),
    so short methods such as ``__init__``/``__repr__`` are still seen.
    """
    if src.tree is None:
        return [src.text]
    lines = src.text.splitlines(keepends=True)
    body = src.tree.body
    cuts = [0]
    head = body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        cuts.append(body[0].end_lineno or 0)  # the module docstring is a document of prose
        head = body[1:]
    # The leading imports are a document of their own: what follows an ``import os`` prompt.
    n_imports = 0
    while n_imports < len(head) and isinstance(head[n_imports], ast.Import | ast.ImportFrom):
        n_imports += 1
    if 0 < n_imports < len(head):
        cuts.append(head[n_imports].lineno - 1)
    cuts += [c for c in _block_starts(body, lines) if c > cuts[-1]]
    cuts.append(len(lines))
    docs = []
    for a, b in itertools.pairwise(sorted(set(cuts))):
        block = "".join(lines[a:b])
        cls = next(
            (n for n in body if isinstance(n, ast.ClassDef) and a < n.lineno <= b),
            None,
        )
        if len(block) > max_chars and cls is not None:
            inner = [c for c in _block_starts(cls.body, lines) if a < c < b]
            docs += _cut(lines, [a, *inner, b])
        else:
            docs += _cut(lines, [a, b])
    return docs


def select_code_docs(files: Sequence[SourceFile], max_chars: int, count: int) -> list[str]:
    """The code corpus: short documents, all import blocks, an even spread of everything else.

    Why so small: ten minutes of 2-core CPU are ~1M training tokens.  A corpus of a few tens of
    thousands of tokens is then seen 10+ times, so the model reproduces real stdlib idioms with
    high confidence instead of mixing half-learned fragments.  The stride keeps every part of
    the stdlib (file order) represented; the choice depends on the stdlib text alone.
    """
    docs = [d for f in files for d in split_top_level(f, max_chars) if len(d) <= max_chars]
    imports = [d for d in docs if d.startswith(("import ", "from "))]
    others = [d for d in docs if not d.startswith(("import ", "from "))]
    want = max(0, min(len(others), count - len(imports)))
    picked = {round(i * len(others) / want) for i in range(want)} if want else set()
    keep = set(imports) | {others[i] for i in picked}
    seen: set[str] = set()
    out = []
    for d in docs:  # file order, each text once
        if d in keep and d not in seen:
            seen.add(d)
            out.append(d)
    return out


def topic_docs(max_chars: int) -> list[str]:
    """The interactive-help topics (``help('FORMATTING')``) that ship in ``pydoc_data``.

    Each is cut to its leading paragraphs within ``max_chars``, like the code documents.
    """
    from pydoc_data.topics import topics

    docs = []
    for name in sorted(topics):
        text = f"Help on {name}:\n\n{topics[name].strip()}\n"
        if len(text) > max_chars:
            cut = text.rfind("\n\n", 0, max_chars)
            text = text[: cut if cut > 0 else max_chars].rstrip() + "\n"
        docs.append(text)
    return docs


# --------------------------------------------------------------------------------------------
# Q/A pairs mined from docstrings
# --------------------------------------------------------------------------------------------


def first_sentence(doc: str | None) -> str | None:
    """The docstring's first sentence if it is a clean one-liner answer, else None."""
    if not doc:
        return None
    para = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.match(r"(.+?\.)(\s|$)", para)
    if not m:
        return None
    sent = m.group(1)
    # Skip fragments ("e.g."), doctest prompts and signatures copied into the docstring.
    if not 20 <= len(sent) <= 100 or ">>>" in sent or sent.endswith(("e.g.", "i.e.", "etc.")):
        return None
    if re.match(r"^[\w.]+\(.*\)", sent) or not sent[0].isupper():
        return None
    return sent


def domain_of(module: str) -> str:
    """Coarse group of a module for the ``domain`` field."""
    return MODULE_DOMAIN.get(module.split(".")[0], "misc")


def is_public(module: str) -> bool:
    """Modules whose docs make good questions (no private ones, no easter eggs)."""
    return not any(p.startswith("_") for p in module.split(".")) and module not in {
        "this",
        "antigravity",
    }


def is_distinct(name: str) -> bool:
    """Names specific enough for "which module defines" (not ``read`` or a builtin's name)."""
    import builtins

    if name in dir(builtins):
        return False
    return name[0].isupper() or "_" in name.strip("_") or len(name) >= 8


def build_qa(files: Sequence[SourceFile], limit: int) -> list[dict[str, str]]:
    """Deterministic Q/A pairs: what a function/class/module does, and where a name lives.

    Per module at most one module question, three function questions, two class questions and
    two "which module" questions, taken in source order.  All of those for the well-known
    ``FEATURED_MODULES`` come first; the rest is filled round-robin over the other modules (each
    module starting at a different kind) so the set spans the stdlib and all question kinds.
    """
    defined_in: dict[str, set[str]] = defaultdict(set)
    for f in files:
        if f.tree is None:
            continue
        for node in f.tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                defined_in[node.name].add(f.module)

    per_module: dict[str, list[dict[str, str]]] = {}
    for f in files:
        if f.tree is None or not is_public(f.module):
            continue
        dom = domain_of(f.module)
        items: list[dict[str, str]] = []
        mod_doc = first_sentence(ast.get_docstring(f.tree))
        if mod_doc:
            items.append(
                {
                    "id": f"module:{f.module}",
                    "domain": dom,
                    "question": f"What does the module `{f.module}` do?",
                    "answer": mod_doc,
                }
            )
        n_func = n_cls = n_where = 0
        for node in f.tree.body:
            if not isinstance(node, ast.FunctionDef | ast.ClassDef) or node.name.startswith("_"):
                continue
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            sent = first_sentence(ast.get_docstring(node))
            if sent and kind == "function" and n_func < 3:
                n_func += 1
            elif sent and kind == "class" and n_cls < 2:
                n_cls += 1
            else:
                sent = None
            if sent:
                items.append(
                    {
                        "id": f"{kind}:{f.module}.{node.name}",
                        "domain": dom,
                        "question": f"What does the {kind} `{f.module}.{node.name}` do?",
                        "answer": sent,
                    }
                )
            # Only names defined in exactly one scanned module have a single right answer.
            if defined_in[node.name] == {f.module} and n_where < 2 and is_distinct(node.name):
                n_where += 1
                items.append(
                    {
                        "id": f"where:{node.name}",
                        "domain": dom,
                        "question": f"Which module defines `{node.name}`?",
                        "answer": f.module,
                    }
                )
        if items:
            per_module[f.module] = items

    qa = [x for mod in FEATURED_MODULES for x in per_module.pop(mod, [])]
    rest = []
    for i, items in enumerate(per_module.values()):
        kinds = ["module", "function", "class", "where"]
        kinds = kinds[i % 4 :] + kinds[: i % 4]
        rest.append(sorted(items, key=lambda x: kinds.index(x["id"].split(":")[0])))
    for rank in range(max((len(x) for x in rest), default=0)):
        qa += [items[rank] for items in rest if rank < len(items)]
    return qa[:limit]


def chat_messages(item: dict[str, str], with_system: bool) -> list[dict[str, str]]:
    """The conversation for one Q/A pair, optionally behind the fixed system prompt."""
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}] if with_system else []
    msgs.append({"role": "user", "content": item["question"]})
    msgs.append({"role": "assistant", "content": item["answer"]})
    return msgs


def domain_qa(notes_path: Path, golden: bool = False) -> list[dict[str, str]]:
    """Q/A pairs that teach the golden set's topics without its questions.

    Each note (``domain``, ``topic``, ``note``) answers its topic under every question form of
    ``bench.golden_templates`` except the two the golden set asks for that domain, so a golden
    question is a known topic in an unseen phrasing, as it would be for a real model.
    ``golden=True`` gives the pairs held out instead: the golden set's own phrasings.
    """
    from bench.golden_templates import DOMAINS, FORMS

    items = []
    for line in notes_path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        role, topics, golden_forms = DOMAINS[row["domain"]]
        if row["topic"] not in topics:
            raise ValueError(f"{notes_path}: {row['topic']!r} is not a {row['domain']} topic")
        for i, form in enumerate(FORMS):
            if (i in golden_forms) != golden:
                continue
            items.append(
                {
                    "id": f"note:{row['domain']}:{row['topic']}:{i}",
                    "domain": row["domain"],
                    "question": form.format(topic=row["topic"], role=role),
                    "answer": row["note"],
                }
            )
    return items


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Render CHAT_TEMPLATE with plain jinja2, the way a loader without transformers does."""
    import jinja2

    return jinja2.Template(CHAT_TEMPLATE).render(
        messages=messages,
        bos_token=BOS,
        eos_token=EOS,
        add_generation_prompt=add_generation_prompt,
    )


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Any:
    """Byte-level BPE (GPT-2 style pre-tokenizer) with SPECIAL_TOKENS at ids 0..5.

    Plain ``encode`` prepends ``<|bos|>`` (post-processor), so a raw prompt gets the same start
    as the training documents; chat renderings already carry it, so encode those with
    ``add_special_tokens=False`` (as ``apply_chat_template`` does).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    return tok


# --------------------------------------------------------------------------------------------
# Batches: windows that start at document starts
# --------------------------------------------------------------------------------------------


class WindowStream:
    """Packed token stream of ``<|bos|> doc <|eos|>`` documents, cut into training windows.

    Windows start at each document start and, for documents longer than a window, every
    ``seq_len`` tokens inside them, so long files are covered too.  Each epoch visits every start
    once in a seeded random order; a window spills into the following documents, wrapping around
    at the end of the stream.
    """

    def __init__(self, docs: list[list[int]], seq_len: int, seed: int, bos: int, eos: int):
        ids: list[int] = []
        starts: list[int] = []
        for doc in docs:
            begin = len(ids)
            ids.append(bos)
            ids.extend(doc)
            ids.append(eos)
            starts.extend(range(begin, len(ids) - 1, seq_len))
        self.n_tokens = len(ids)
        self.stream = torch.tensor(ids + ids[:seq_len], dtype=torch.long)
        self.starts = torch.tensor(starts, dtype=torch.long)
        self.seq_len = seq_len
        self.gen = torch.Generator().manual_seed(seed)
        self._order: Iterator[int] = iter(())
        self.drawn = 0

    @property
    def passes(self) -> float:
        """How many times the windows drawn so far cover the stream's tokens."""
        return self.drawn * self.seq_len / self.n_tokens

    def next_window(self) -> torch.Tensor:
        """The next ``seq_len`` tokens window in this epoch's order."""
        try:
            i = next(self._order)
        except StopIteration:
            self._order = iter(torch.randperm(len(self.starts), generator=self.gen).tolist())
            i = next(self._order)
        s = int(self.starts[i])
        self.drawn += 1
        return self.stream[s : s + self.seq_len]


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def build_config(args: argparse.Namespace, vocab_size: int) -> Any:
    """LlamaConfig for the demo shape (GQA, untied head so every tensor is explicit on disk)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_positions,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        use_cache=True,
    )


class Schedule:
    """Warmup, constant, then linear decay to zero over the last ``decay_frac`` of the run.

    With a time limit the run length follows what the recent step time allows (never more than
    the planned steps, and frozen once the decay has begun), so a slow or shared machine still
    ends with an annealed model; without one the schedule depends on the step number alone, so
    runs are reproducible.
    """

    def __init__(self, peak: float, warmup: int, planned: int, decay_frac: float):
        self.peak, self.warmup, self.decay_frac = peak, warmup, decay_frac
        self.planned = self.total = planned
        self.decay_start: int | None = None

    def replan(self, step: int, steps_left_by_time: float) -> None:
        """Fit the run length to the deadline while still in the constant phase."""
        if self.decay_start is None:
            self.total = max(step + 1, min(self.planned, int(step + steps_left_by_time)))

    def lr(self, step: int) -> float:
        """Learning rate for 0-based ``step``."""
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        decay_len = max(1, round(self.total * self.decay_frac))
        start = self.total - decay_len
        if step < start:
            return self.peak
        if self.decay_start is None:
            self.decay_start = step
        return self.peak * max(0.0, (self.total - step) / (self.total - self.decay_start + 1))


def train(
    args: argparse.Namespace,
    model: Any,
    code: WindowStream,
    chat: WindowStream,
    deadline: float | None,
) -> dict[str, Any]:
    """AdamW training loop in fp32; returns run statistics for the model card."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    sched = Schedule(args.lr, args.warmup, args.steps, args.decay_frac)
    chat_per_step = args.batch_size * args.chat_frac
    tokens_per_step = args.batch_size * args.seq_len
    losses: list[float] = []
    ema: float | None = None
    t0 = time.monotonic()
    stamps = [t0]
    step = 0
    model.train()
    while step < sched.total:
        if deadline is not None and step >= 5:
            # Recent steps only: the first ones pay for lazy init, and other jobs come and go.
            recent = stamps[-21:]
            per_step = (recent[-1] - recent[0]) / (len(recent) - 1)
            left = deadline - time.monotonic()
            if left < per_step:
                print(f"time limit: stopping after {step} steps", flush=True)
                break
            sched.replan(step, 0.95 * left / per_step)
        lr = sched.lr(step)
        for group in opt.param_groups:
            group["lr"] = lr
        # Fractional share: e.g. 0.6 chat windows per step -> 0,1,1,0,1,... (deterministic).
        n_chat = math.floor((step + 1) * chat_per_step) - math.floor(step * chat_per_step)
        rows = [chat.next_window() for _ in range(min(n_chat, args.batch_size))]
        rows += [code.next_window() for _ in range(args.batch_size - len(rows))]
        batch = torch.stack(rows)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        stamps.append(time.monotonic())
        value = float(loss.detach())
        losses.append(value)
        ema = value if ema is None else 0.9 * ema + 0.1 * value
        if step % args.log_every == 0 or step == 1 or step == sched.total:
            elapsed = time.monotonic() - t0
            tps = step * tokens_per_step / elapsed
            eta = (sched.total - step) * elapsed / step
            print(
                f"step {step:4d}/{sched.total} loss {value:.3f} (ema {ema:.3f}) lr {lr:.2e} "
                f"{tps:,.0f} tok/s elapsed {elapsed:.0f}s eta {eta:.0f}s",
                flush=True,
            )
    model.eval()
    elapsed = time.monotonic() - t0
    tail = losses[-20:]
    return {
        "steps": step,
        "planned_steps": args.steps,
        "time_limited": step < args.steps,
        "train_seconds": elapsed,
        "tokens_seen": step * tokens_per_step,
        "tokens_per_s": step * tokens_per_step / max(elapsed, 1e-9),
        "final_loss": sum(tail) / max(1, len(tail)),
        "first_loss": losses[0] if losses else float("nan"),
        "code_passes": code.passes,
        "chat_passes": chat.passes,
    }


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------


def save_folder(model: Any, tok: Any, out: Path, max_positions: int) -> None:
    """Write the HF folder: weights + config via transformers, tokenizer files by hand."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*"):
        if stale.is_file():
            stale.unlink()
    model.save_pretrained(out, safe_serialization=True)
    # transformers 5 writes "dtype" and nests rope_theta in "rope_parameters"; also write the
    # classic top-level keys that older readers and hand-written loaders look for.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["torch_dtype"] = "float32"
    cfg["dtype"] = "float32"
    cfg["rope_theta"] = float(cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg_path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")

    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": SPECIAL_TOKENS[3:],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_positions,
        "padding_side": "left",  # decoder-only batch generation
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen_cfg = {
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": tok.token_to_id(EOS),
        "pad_token_id": tok.token_to_id(PAD),
        "do_sample": False,
        "max_length": max_positions,
    }
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------------


def reference_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    """Llama forward in plain torch from config.json + model.safetensors (no transformers).

    This is the contract a hand-written loader has to meet: HF parameter names, rotate-half RoPE,
    GQA by repeating KV heads, RMSNorm with weight, SwiGLU MLP, untied ``lm_head``.
    """
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    t = len(ids)

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(x: torch.Tensor) -> torch.Tensor:
        inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.outer(torch.arange(t, dtype=torch.float32), inv)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        rot = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
        return x * cos + rot * sin

    h = w["model.embed_tokens.weight"][torch.tensor(ids)]
    mask = torch.full((t, t), float("-inf")).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(t, nh, hd).transpose(0, 1)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd) + mask, -1)
        o = (att @ v).transpose(0, 1).reshape(t, nh * hd)
        h = h + o @ w[p + "self_attn.o_proj.weight"].T
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T)
        h = h + (gate * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return rms(h, w["model.norm.weight"]) @ w["lm_head.weight"].T


CODE_PROMPTS = ["def __init__(self", "import os\n", "class ", "    def __repr__(self):\n"]


def qa_exact_match(model: Any, tok: Any, qa: list[dict[str, str]]) -> dict[str, float]:
    """Teacher-forced greedy check on every Q/A pair (no system prompt).

    A pair counts as exact when the argmax at every answer position (and at the closing eos)
    is the reference token, which is exactly when greedy decoding reproduces the answer.
    """
    rows = []
    for item in qa:
        msgs = chat_messages(item, False)
        p_ids = tok.encode(render_chat(msgs[:-1], True), add_special_tokens=False).ids
        full = tok.encode(render_chat(msgs), add_special_tokens=False).ids
        # Tokenized as in training (whole conversation); the answer is what follows the prompt.
        assert full[: len(p_ids)] == p_ids
        rows.append((full, len(p_ids)))
    pad = tok.token_to_id(PAD)
    exact, probs = 0, []
    with torch.no_grad():
        for i in range(0, len(rows), 64):
            chunk = rows[i : i + 64]
            width = max(len(full) for full, _ in chunk)
            # Right padding needs no mask: causal attention never looks at later positions.
            ids = torch.tensor([full + [pad] * (width - len(full)) for full, _ in chunk])
            logits = model(input_ids=ids).logits.float()
            for j, (full, n_prompt) in enumerate(chunk):
                pred = logits[j, n_prompt - 1 : len(full) - 1]
                target = torch.tensor(full[n_prompt:])
                exact += int(bool((pred.argmax(-1) == target).all()))
                sm = torch.softmax(pred, -1)
                probs.append(float(sm[torch.arange(len(target)), target].mean()))
    return {"exact": exact / len(qa), "mean_answer_token_prob": sum(probs) / len(probs)}


def greedy(model: Any, ids: list[int], max_new: int, eos: int) -> tuple[list[int], float]:
    """Greedy decode with transformers; returns new ids and the mean top-1 probability."""
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos,
        output_scores=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[0, len(ids) :].tolist()
    top1 = [float(torch.softmax(s[0].float(), -1).max()) for s in out.scores]
    return new, sum(top1) / max(1, len(top1))


def verify(
    folder: Path,
    qa: list[dict[str, str]],
    notes_qa: list[dict[str, str]],
    heldout_qa: list[dict[str, str]],
) -> dict[str, Any]:
    """Load the saved folder three ways and generate; raise if anything disagrees."""
    import jinja2
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    hf_tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert isinstance(model, LlamaForCausalLM), type(model)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    eos = raw.token_to_id(tok_cfg["eos_token"])
    if eos is None:
        raise ValueError(f"{folder}: the tokenizer has no id for {tok_cfg['eos_token']!r}")

    # Chat template: plain jinja2 + tokenizers must equal transformers, string and ids.
    sample = qa[0]
    for with_system in (False, True):
        msgs = chat_messages(sample, with_system)[:-1]
        plain = jinja2.Template(tok_cfg["chat_template"]).render(
            messages=msgs,
            bos_token=tok_cfg["bos_token"],
            eos_token=tok_cfg["eos_token"],
            add_generation_prompt=True,
        )
        hf_text = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert plain == hf_text, (plain, hf_text)
        assert plain.endswith("<|assistant|>\n")
        hf_ids = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(hf_ids, dict) or hasattr(hf_ids, "input_ids"):
            hf_ids = hf_ids["input_ids"]
        assert list(hf_ids) == raw.encode(plain, add_special_tokens=False).ids
    assert hf_tok("class ").input_ids == raw.encode("class ").ids

    # Plain-torch reference forward must match transformers.
    probe = raw.encode("def __init__(self, name):\n    self.name = name\n").ids
    with torch.no_grad():
        hf_logits = model(input_ids=torch.tensor([probe])).logits[0].float()
    ref_diff = float((reference_logits(folder, probe) - hf_logits).abs().max())
    assert ref_diff < 1e-3, ref_diff

    samples = []
    for prompt in CODE_PROMPTS:
        new, conf = greedy(model, raw.encode(prompt).ids, 48, eos)
        samples.append({"prompt": prompt, "completion": raw.decode(new), "top1": conf})
    shown = [qa[0], qa[len(qa) // 2], qa[-1], *notes_qa[:1], *heldout_qa[:1]]
    for item in shown:
        text = render_chat(chat_messages(item, False)[:-1], add_generation_prompt=True)
        new, conf = greedy(model, raw.encode(text, add_special_tokens=False).ids, 48, eos)
        samples.append(
            {"prompt": text, "completion": raw.decode(new), "top1": conf, "ref": item["answer"]}
        )
    return {
        "samples": samples,
        "ref_max_abs_diff": ref_diff,
        "qa": qa_exact_match(model, raw, qa),
        "notes_qa": qa_exact_match(model, raw, notes_qa) if notes_qa else None,
        "heldout_qa": qa_exact_match(model, raw, heldout_qa) if heldout_qa else None,
    }


# --------------------------------------------------------------------------------------------
# Model card
# --------------------------------------------------------------------------------------------


def folder_bytes(folder: Path) -> int:
    """Total size of the files in ``folder``."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def write_card(out: Path, info: dict[str, Any]) -> None:
    """TRAINING.md: data, shape, run statistics, verification, samples, exact command."""
    a, s, v, c = info["args"], info["stats"], info["verify"], info["config"]
    lines = [
        "# pystd-tiny",
        "",
        "Tiny Llama-architecture causal LM, the qosserve demo model. Trained from scratch on text",
        "that ships with CPython and on short topic notes kept in this repository, so it is",
        "reproducible offline. It is a test fixture for the serving stack, not a useful",
        "assistant: its point is fast, deterministic, confident output.",
        "",
        "## Data",
        "",
        f"- Python {info['python']} stdlib at `sysconfig.get_paths()['stdlib']`: "
        f"{info['n_files']} files (`Lib/*.py` + {', '.join(EXTRA_PACKAGES)}), split at top-level "
        "docstring, leading imports, def/class (long classes at their methods); "
        f"{info['n_code_docs']} documents of at most {a.max_doc_chars} characters are kept: "
        "every import block plus an even spread over the stdlib (a corpus small enough to be "
        f"seen 10+ times: confident outputs). Skipped: {', '.join(SKIP_MODULES)}.",
        f"- `pydoc_data.topics`: {info['n_topics']} help topics, each cut to "
        f"{a.max_doc_chars} characters.",
        f"- {info['n_qa']} Q/A pairs mined from docstrings with `ast` "
        "(also in `bench/data/stdlib_qa.jsonl`), rendered with the chat template; half of them "
        f'behind the system prompt "{SYSTEM_PROMPT}".',
        f"- {info['n_notes_qa']} Q/A pairs that teach the golden set's everyday topics "
        "(`bench/data/domain_notes.jsonl`: a two-sentence note per topic, the answer under "
        "every question form except the two the golden set asks for that domain), so a golden "
        "question is a known topic in an unseen phrasing.",
        f"- Tokens: code+docs {info['code_tokens']:,}, chat {info['chat_tokens']:,}. "
        f"Corpus sha256 `{info['corpus_sha'][:16]}`.",
        "",
        "## Tokenizer",
        "",
        f"Byte-level BPE (`tokenizers`), vocab {c['vocab_size']}, special tokens "
        f"{', '.join(f'`{t}`={i}' for i, t in enumerate(SPECIAL_TOKENS))}. `encode()` prepends "
        "`<|bos|>`; the chat template starts with it already, so encode rendered chats with "
        "`add_special_tokens=False`. Every turn ends with `<|eos|>`, the only stop token.",
        "",
        "```jinja",
        CHAT_TEMPLATE,
        "```",
        "",
        "## Shape",
        "",
        f"hidden {c['hidden_size']}, layers {c['num_hidden_layers']}, heads "
        f"{c['num_attention_heads']} (head_dim {c['head_dim']}), KV heads "
        f"{c['num_key_value_heads']} (GQA), intermediate {c['intermediate_size']}, "
        f"vocab {c['vocab_size']}, untied lm_head, RoPE theta {c['rope_theta']}, "
        f"RMSNorm eps {c['rms_norm_eps']}, max positions {c['max_position_embeddings']}. "
        f"**{info['params']:,} parameters**, stored fp32; folder {info['folder_mb']:.2f} MB.",
        "",
        "## Training",
        "",
        f"- fp32 on CPU, {a.threads} threads, torch {torch.__version__}, seed {a.seed}.",
        f"- {s['steps']} steps (planned {s['planned_steps']}"
        + (", cut by the time limit" if s["time_limited"] else "")
        + f") x {a.batch_size} windows x {a.seq_len} tokens "
        f"({a.chat_frac:.0%} of windows from the chat stream); "
        f"{s['tokens_seen']:,} tokens: {s['code_passes']:.1f} passes over the code+docs tokens, "
        f"{s['chat_passes']:.1f} over the chat tokens.",
        f"- AdamW (0.9, 0.95), wd 0.1, clip 1.0, peak lr {a.lr}, warmup {a.warmup}, "
        f"linear decay over the last {a.decay_frac:.0%}.",
        f"- Loss {s['first_loss']:.3f} -> **{s['final_loss']:.3f}** (mean of the last 20 steps).",
        f"- Training {s['train_seconds']:.0f} s ({s['tokens_per_s']:,.0f} tok/s); whole script "
        f"{info['total_seconds']:.0f} s.",
        "",
        "## Verification (run by the script)",
        "",
        "- `AutoTokenizer` / `AutoModelForCausalLM` load the folder as `LlamaForCausalLM` and "
        "generate greedily.",
        "- `tokenizers.Tokenizer.from_file` + `jinja2.Template(chat_template)` give the same text "
        "and ids as `apply_chat_template`.",
        f"- A plain-torch Llama forward from `config.json` + `model.safetensors` matches the "
        f"transformers logits (max abs diff {v['ref_max_abs_diff']:.1e}).",
        f"- Q/A greedy exact match (teacher-forced, no system prompt): "
        f"{v['qa']['exact']:.1%}; mean answer-token probability "
        f"{v['qa']['mean_answer_token_prob']:.3f}."
        + (
            f" Topic notes: {v['notes_qa']['exact']:.1%}, "
            f"{v['notes_qa']['mean_answer_token_prob']:.3f}; the same notes under the golden "
            f"set's held-out phrasings: {v['heldout_qa']['exact']:.1%}, "
            f"{v['heldout_qa']['mean_answer_token_prob']:.3f}."
            if v.get("notes_qa")
            else ""
        ),
        "",
        "## Greedy samples",
        "",
    ]
    for smp in v["samples"]:
        lines += [
            f"mean top-1 probability {smp['top1']:.3f}"
            + (f" (reference answer: {smp['ref']!r})" if "ref" in smp else ""),
            "",
            "```text",
            smp["prompt"] + smp["completion"],
            "```",
            "",
        ]
    lines += [
        "## Reproduce",
        "",
        "From the repository root, with the project venv:",
        "",
        "```bash",
        info["command"],
        "```",
        "",
        "Same Python version (stdlib text), torch version and thread count give the same "
        "weights when the run is not cut by `--time-limit-s`.",
        "",
    ]
    (out / "TRAINING.md").write_text("\n".join(lines))


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Build data, train, save, verify, write the card; prints a summary."""
    args = parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + args.time_limit_s if args.time_limit_s > 0 else None
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.use_deterministic_algorithms(True)

    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    root = stdlib_root()
    files = load_sources(root)
    code_texts = select_code_docs(files, args.max_doc_chars, args.code_docs)
    topics = topic_docs(args.max_doc_chars)
    qa = build_qa(files, args.max_qa)
    args.qa_out.parent.mkdir(parents=True, exist_ok=True)
    with args.qa_out.open("w", encoding="utf-8") as fh:
        for item in qa:
            fh.write(json.dumps(item, ensure_ascii=False) + "\n")
    notes_qa = domain_qa(args.domain_notes) if args.domain_notes else []
    # The stdlib system prompt goes only with stdlib questions (half of them).
    chat_texts = [render_chat(chat_messages(x, i % 2 == 1)) for i, x in enumerate(qa)]
    chat_texts += [render_chat(chat_messages(x, False)) for x in notes_qa]
    print(
        f"data: {len(files)} files -> {len(code_texts)} code docs, {len(topics)} topics, "
        f"{len(qa)} Q/A pairs, {len(notes_qa)} topic-note pairs "
        f"({time.monotonic() - t_start:.0f}s)",
        flush=True,
    )

    # Role/bos/eos strings in the chat texts are special tokens, so they never enter merges.
    tok = train_tokenizer(code_texts + topics + chat_texts, args.vocab_size)
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)

    def encode_all(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    code_docs = encode_all(code_texts + topics)
    # Chat renderings carry their own bos/eos; strip them, WindowStream adds them back.
    chat_docs = [ids[1:-1] for ids in encode_all(chat_texts)]
    random.Random(args.seed).shuffle(chat_docs)  # mix domains inside each chat window
    corpus_sha = hashlib.sha256(
        "\x00".join(code_texts + topics + chat_texts).encode("utf-8")
    ).hexdigest()
    code = WindowStream(code_docs, args.seq_len, args.seed, bos, eos)
    chat = WindowStream(chat_docs, args.seq_len, args.seed + 1, bos, eos)
    print(
        f"tokenizer: vocab {tok.get_vocab_size()}, code tokens {code.n_tokens:,}, "
        f"chat tokens {chat.n_tokens:,} ({time.monotonic() - t_start:.0f}s)",
        flush=True,
    )

    config = build_config(args, tok.get_vocab_size())
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).float()
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {params:,} params, hidden {args.hidden}, layers {args.layers}, heads "
        f"{args.heads}/{args.kv_heads} kv, intermediate {args.intermediate}",
        flush=True,
    )

    # Keep ~60 s for saving and verification inside the time limit (more on a busy CPU).
    train_deadline = None if deadline is None else deadline - 60.0
    stats = train(args, model, code, chat, train_deadline)

    save_folder(model, tok, args.out, args.max_positions)
    heldout_qa = domain_qa(args.domain_notes, golden=True) if args.domain_notes else []
    report = verify(args.out, qa, notes_qa, heldout_qa)
    cmd = "python -m bench.train_tiny " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    info = {
        "args": args,
        "stats": stats,
        "verify": report,
        "config": json.loads((args.out / "config.json").read_text()),
        "python": sys.version.split()[0],
        "n_files": len(files),
        "n_code_docs": len(code_texts),
        "n_topics": len(topics),
        "n_qa": len(qa),
        "n_notes_qa": len(notes_qa),
        "code_tokens": code.n_tokens,
        "chat_tokens": chat.n_tokens,
        "corpus_sha": corpus_sha,
        "params": params,
        "command": cmd.strip(),
        "total_seconds": time.monotonic() - t_start,
        "folder_mb": 0.0,
    }
    write_card(args.out, info)
    # The card's own size barely moves the total; write it again with the final number.
    info["folder_mb"] = folder_bytes(args.out) / 1e6
    info["total_seconds"] = time.monotonic() - t_start
    write_card(args.out, info)

    for smp in report["samples"]:
        print(f"--- top1 {smp['top1']:.3f}\n{smp['prompt']}{smp['completion']}")
    print(
        f"done: {stats['steps']} steps, final loss {stats['final_loss']:.3f}, "
        f"QA exact {report['qa']['exact']:.1%}, folder {info['folder_mb']:.2f} MB, "
        f"{info['total_seconds']:.0f}s total -> {args.out}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
