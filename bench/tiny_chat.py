"""What the demo model is taught to answer (``bench/train_tiny.py``): its special tokens and
chat template, question/answer pairs mined from stdlib docstrings with ``ast``, and the golden
set's everyday topics from ``bench/data/domain_notes.jsonl``."""

from __future__ import annotations

import ast
import json
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from bench.tiny_corpus import SourceFile

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
