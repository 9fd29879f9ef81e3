"""bench/locustfile.py headless against a sim-engine stack on loopback: CSV out, every invalid
request answered 4xx, no failure (no 5xx, no hang), TTFT and ITL recorded as events."""

from __future__ import annotations

import csv
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.field_mix import INVALID_KINDS, MIX, long_document, task_weights
from bench.locust_run import summary
from bench.up_stack import ROOT, UpStack


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_headless_run_writes_csv_refuses_every_invalid_request_with_4xx_and_never_fails(
    tmp_path: Path,
) -> None:
    locust = shutil.which("locust", path=str(Path(sys.executable).parent)) or shutil.which("locust")
    assert locust is not None, "locust comes with the dev extra"
    prefix = tmp_path / "report"
    with UpStack(engine="sim", replicas={"realtime": 0}) as stack:
        proc = subprocess.run(
            [locust, "-f", "bench/locustfile.py", "--headless", "--users", "6",
             "--spawn-rate", "6", "--host", stack.url, "--csv", str(prefix), "-t", "15s",
             "--only-summary", "--long-tokens", "300", "--max-tokens", "16",
             # More invalid requests than the field's 5 %, so every kind is sent in 15 s.
             "--mix", "invalid=40"],
            cwd=ROOT, env={k: v for k, v in os.environ.items() if not k.startswith("QOS_")},
            capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        gateway_log = stack.child_log("gateway", chars=2_000_000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for suffix in ("stats", "failures", "stats_history", "exceptions"):
        assert (tmp_path / f"report_{suffix}.csv").is_file(), suffix
    assert rows(tmp_path / "report_failures.csv") == [], "a request failed (5xx, 2xx, hang)"

    stats = [r for r in rows(tmp_path / "report_stats.csv") if r["Name"] != "Aggregated"]
    invalid = {
        r["Name"].removeprefix("invalid "): r for r in stats if r["Name"].startswith("invalid")
    }
    assert len(invalid) >= len(INVALID_KINDS) - 1, f"kinds sent: {sorted(invalid)}"
    assert all(r["Failure Count"] == "0" for r in invalid.values())
    assert sum(int(r["Request Count"]) for r in invalid.values()) >= 20

    by_type: dict[str, set[str]] = {}
    for r in stats:
        by_type.setdefault(r["Type"], set()).add(r["Name"])
    for kind in ("TTFT", "ITL"):
        assert {"short", "long_doc", "conversation turn 2"} <= by_type.get(kind, set()), kind
    # The gateway's access log agrees: no 5xx at all (the tail covers the end of the run).
    assert "status=4" in gateway_log and not re.search(r"status=5\d\d", gateway_log)


def test_task_weights_give_the_field_mix_per_request_sent() -> None:
    """A conversation task sends ``turns`` requests: weighted like the others, the turns
    made 56 % of the requests where the mix says 28 %."""
    for turns in (1, 3, 5):
        weights = task_weights(MIX, turns)
        sent = {k: w * (turns if k == "conversation" else 1) for k, w in weights.items()}
        total = sum(sent.values())
        assert {k: n / total for k, n in sent.items()} == {k: w / sum(MIX.values())
                                                             for k, w in MIX.items()}  # fmt: skip


def test_the_task_order_keeps_the_mix_at_every_moment_of_a_run() -> None:
    """Locust drew each task at random (its global random, unseeded): a 60 s run of ~730
    tasks carried 16.8 % long documents and 24.3 % turns where the mix says 19 and 28.5.
    Interleaved, every kind's count is within one of its share after any number of tasks."""
    from bench.field_mix import interleaved

    for weights in (task_weights(MIX, 3), {"long_doc": 1, "short": 99}, {"a": 3, "b": 0, "c": 7}):
        order, total = interleaved(weights), sum(weights.values())
        counts = dict.fromkeys(weights, 0)
        for n in range(1, 3001):
            counts[next(order)] += 1
            assert all(abs(counts[k] - n * w / total) < 1 for k, w in weights.items()), (n, counts)
    with pytest.raises(ValueError):
        next(interleaved({"a": 0}))


def test_the_summary_gives_each_kinds_share_and_the_valid_rate() -> None:
    def row(name: str, n: int, rate: float) -> dict[str, str]:
        return {"Type": "POST", "Name": name, "Request Count": str(n), "Failure Count": "0",
                "50%": "1", "95%": "1", "99%": "1", "Requests/s": str(rate)}  # fmt: skip

    got = summary([
        row("conversation turn 1", 10, 1.0), row("conversation turn 2", 10, 1.0),
        row("short", 25, 2.5), row("invalid wrong_type", 5, 0.5),
        row("short (429, retried)", 3, 0.3), row("short (failed)", 2, 0.2),
    ])  # fmt: skip
    assert got["request_share_pct"] == {"conversation": 38.5, "short": 51.9, "invalid": 9.6}
    # Failed requests are sent (in the mix) but not answered (not in the valid rate).
    assert (got["req_s"], got["valid_req_s"]) == (5.2, 4.5)
    assert got["retried_after_429"] == 3 and got["requests"] == 52
    # A row nothing was sent on has "N/A" percentiles (the run's summary died on them).
    idle = {**row("idle", 0, 0.0), "Type": "GET", "50%": "N/A", "95%": "N/A", "99%": "N/A"}
    assert summary([idle])["by_request"]["GET idle"]["p50_ms"] is None


def test_the_default_long_document_leaves_room_for_the_template_and_the_question() -> None:
    """Sized as the long group's limit less max_tokens less 16, a document with the chat
    template and a question around it (26-44 tokens on the demo model) overflowed the
    limit: every long_doc request of the documented command was a 400. The room is now
    what the gateway's /tokenize counts around it, here with the demo model's tokenizer."""
    from bench.field_mix import load_qa, long_doc_chat, long_doc_probe, long_doc_tokens
    from common.tokenizer import load_tokenizer

    qa = load_qa()
    tok = load_tokenizer(str(ROOT / "bench" / "models" / "pystd-tiny"))

    def chat_tokens(messages: list[dict[str, str]]) -> int:  # what /tokenize counts
        return len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True)))

    around = chat_tokens(long_doc_probe(qa))
    assert around > 16  # the slack that was there
    size = long_doc_tokens(2048, 32, around)
    document = long_document(qa, size, tok, random.Random(0))
    worst = max(chat_tokens(long_doc_chat(document, item.question)) for item in qa)
    assert worst + 32 <= 2048


# The locust file's own methods, in a child process: importing locust monkey-patches the
# process (gevent), which pytest's must not be. A FieldMixUser made without locust's
# environment, its request and event hooks replaced by recorders.
DRIVE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import locustfile
from bench.field_mix import load_qa

User = locustfile.FieldMixUser


class Resp:
    status_code, text = 200, ""

    def __init__(self, events):
        self.lines = [f"data: {json.dumps(e)}" for e in events] + ["data: [DONE]"]
        self.request_meta, self.verdict = {}, None

    def iter_lines(self, decode_unicode=True):
        yield from self.lines

    def failure(self, why):
        self.verdict = "failure " + why

    def success(self):
        self.verdict = "success"


def user():
    u = object.__new__(User)
    u.fired = []
    u._event = lambda kind, name, ms: u.fired.append(kind)
    return u


out = {}
for case, events in json.loads(sys.argv[2]).items():
    u, resp = user(), Resp(events)
    u._stream(resp, "short", 0.0)
    out[case] = {"fired": u.fired, "verdict": resp.verdict}

User._qa = load_qa()
for pool in (0, 4):
    u = user()
    import random
    u.rng, u.long_tokens, u.tokenizer_path = random.Random(0), 120, ""
    u.seed, u.long_doc_pool, u.worker_index = 0, pool, 0
    sent = []
    # The document: the prompt less its question (after the last blank line).
    u._chat = lambda path, name, messages: sent.append(messages[0]["content"].rsplit("\n\n", 1)[0])
    for _ in range(40):
        u.long_doc()
    out[f"pool {pool}"] = {"distinct": len(set(sent)), "kept": len(User._documents)}
print(json.dumps(out))
"""

ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
FINISH = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}


def usage(tokens: int) -> dict[str, object]:
    return {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": tokens}}


def drive(folder: Path = ROOT / "bench") -> dict[str, dict[str, object]]:
    """Run DRIVE on ``folder``'s locustfile.py (a copy of an older one, to compare)."""
    cases = {
        # Just an EOS: one token, no text; its TTFT was never recorded.
        "eos only": [ROLE, FINISH, usage(1)],
        # No token at all: no TTFT is right, but it was counted nowhere.
        "no tokens": [ROLE, FINISH, usage(0)],
        "text": [ROLE, {"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
                 {"choices": [{"index": 0, "delta": {"content": "!"}}]}, FINISH, usage(2)],
    }  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", DRIVE, str(folder), json.dumps(cases)], cwd=ROOT,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_locust_file_times_textless_answers_and_counts_tokenless_ones() -> None:
    got = drive()
    assert got["text"] == {"fired": ["TTFT", "ITL"], "verdict": "success"}
    assert got["eos only"] == {"fired": ["TTFT"], "verdict": "success"}
    assert got["no tokens"] == {"fired": ["NO_TOKENS"], "verdict": "success"}


def test_long_documents_are_distinct_per_request_unless_a_pool_is_asked_for() -> None:
    """Four documents for every long-document request made long-context TTFT a prefix-cache
    hit; the field study's documents are distinct."""
    got = drive()
    assert got["pool 0"] == {"distinct": 40, "kept": 0}  # none kept: made per request
    assert got["pool 4"]["distinct"] == 4 and got["pool 4"]["kept"] == 4


def test_a_run_off_the_mix_is_measured_against_the_field_shares() -> None:
    """The 2026-12-03 run's completed requests were 16.8 / 24.3 / 53.4 / 5.5 %: nothing said
    it was 5.9 points off the mix its figure was quoted for."""
    from bench.locust_run import mix_off_pts, target_share_pct

    assert target_share_pct() == {"long_doc": 19.0, "conversation": 28.5, "short": 47.5,
                                  "invalid": 5.0}  # fmt: skip
    shares = {"conversation": 24.3, "invalid": 5.5, "long_doc": 16.8, "short": 53.4}
    assert mix_off_pts(shares) == 5.9 and mix_off_pts(target_share_pct()) == 0.0
