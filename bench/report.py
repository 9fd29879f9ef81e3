"""One Markdown report from every benchmark result present: ``REPORT.md`` + PNGs.

Reads the JSON each benchmark writes with ``--out`` (and locust's ``*_stats.csv``) from a
results folder — by default ``bench/results/`` and each of its subfolders (``cpu/``, ``gpu/``
…) as its own part — and writes ``REPORT.md`` next to them with the commands that produced
them, the machines they ran on, the headline figures and plots. A benchmark without a
result gets a line saying so. Known: engine, kernels, serve, kvtier, incident, policies,
golden, tracing_overhead, locust; any other JSON is listed with its scalar figures.

    python -m bench.report                         # bench/results/REPORT.md
    python -m bench.report --results bench/results/cpu
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import policies as policies_bench
from bench import report_plots
from bench.replicas import top_step_was_a_retry, without_retries

RESULTS = Path(__file__).resolve().parent / "results"
KNOWN = ("engine", "kernels", "serve", "replicas", "kvtier", "incident", "policies", "golden",
         "tracing_overhead", "locust", "kvquant")  # fmt: skip
# How each benchmark is run when its JSON does not record the command line.
DEFAULT_COMMANDS = {
    "engine": "python -m bench.engine --model bench/models/pystd-tiny --out engine.json",
    "kernels": "python -m bench.kernels --out kernels.json",
    "serve": "python -m bench.serve --launch real --out serve.json",
    "replicas": "python -m bench.replicas --out replicas.json",
    "kvtier": "python -m bench.kvtier --out kvtier.json",
    "incident": "python -m bench.incident --png incident.png > incident.json",
    "policies": "python -m bench.policies --out policies.json",
    "golden": "python -m bench.golden --out golden.json",
    "tracing_overhead": "python -m bench.tracing_overhead --out tracing_overhead.json",
    "locust": "locust -f bench/locustfile.py --headless --users 100 --spawn-rate 10 "
    "--host http://127.0.0.1:8000 --csv=locust -t 1h",
}
Doc = dict[str, Any]


def kind_of(path: Path, doc: Doc) -> str:
    """The benchmark a JSON file holds: its ``benchmark`` key, else its file name."""
    name = str(doc.get("benchmark") or path.stem)
    return next((k for k in KNOWN if name == k or name.startswith(k)), name)


def collect(folder: Path) -> dict[str, list[tuple[Path, Doc]]]:
    """Every result JSON (and locust CSV) directly in ``folder``, by benchmark."""
    found: dict[str, list[tuple[Path, Doc]]] = {}
    for path in sorted(folder.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            found.setdefault(kind_of(path, doc), []).append((path, doc))
    # Locust writes CSV; a locust JSON (command, machine) may name its stats file.
    named = {d.get("stats_csv") for _, d in found.get("locust", [])}
    for _, doc in found.get("locust", []):
        doc["rows"] = _csv_rows(folder / str(doc.get("stats_csv", "")))
    for path in sorted(folder.glob("*_stats.csv")):
        if path.name not in named:
            found.setdefault("locust", []).append((path, {"rows": _csv_rows(path)}))
    return found


def _csv_rows(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def table(head: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return "—" if v is None else str(v)

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# --- sections --------------------------------------------------------------------------------


def section_policies(doc: Doc, png: Path) -> list[str]:
    w = doc["workload"]
    out = [f"Workload: {w['mix']}; fixed rate {w['rate_sessions_s']} sessions/s for "
           f"{w['duration_s']} s, sweep x{w['sweep_factors']} of it, {w['step_s']} s a step."]  # fmt: skip
    if "model" in doc:
        out[0] += f" Model `{doc['model']}` on {doc.get('device', 'cpu')}."
    rows = []
    for policy, r in doc["results"].items():
        for group, g in r["fixed_rate"]["groups"].items():
            busy = r["fixed_rate"]["engine"].get(group, {}).get("busy_fraction")
            rows.append([policy, group, g["req_s"], g["out_tok_s"], g["goodput_req_s"],
                         g["ttft_p50_ms"], g["ttft_p99_ms"], g["e2e_p50_ms"], g["e2e_p99_ms"], busy])  # fmt: skip
    out.append(table(["policy", "group", "req/s", "out tok/s", "goodput/s", "TTFT p50 ms",
                      "TTFT p99 ms", "E2E p50 ms", "E2E p99 ms", "engine busy"], rows))  # fmt: skip
    # Recomputed from the sweeps, so results written before the rate at SLO existed get it too.
    rel = policies_bench.ratios(doc["results"])
    pool = policies_bench.ratios(doc["results"], policies_bench.FIELD_BASELINE)

    def bounds(x: dict[str, Any]) -> str | None:
        low, high = x.get("slo_rate_low"), x.get("slo_rate_high")
        return f"{low or 0:.3g}–{'∞' if high is None else format(high, '.3g')}" if x else None

    sat = []
    for p, r in doc["results"].items():
        at = policies_bench.sweep_slo(r["sweep"])
        x, y = rel.get(p, {}), pool.get(p, {})
        sat.append([p, at.rate, at.req_s, at.first_miss, x.get("slo_rate"), bounds(x),
                    y.get("slo_rate"), bounds(y), r["saturation_req_s"],
                    x.get("saturation_req_s"), x.get("fixed_goodput_req_s")])  # fmt: skip
    out.append(table(["policy", "rate at SLO (sessions/s)", "req/s there", "first miss",
                      "x dynamic at SLO", "bounds", "x dynamic/pool at SLO", "bounds",
                      "saturation req/s", "x dynamic (saturation)",
                      "x dynamic (fixed-rate goodput)"], sat))  # fmt: skip
    out.append("Rate at SLO: the highest offered rate below the first sweep step where realtime's "
               "or short's E2E p99 exceeds its group SLO, long's TTFT p99 its slo_ttft_ms, or "
               "under 99 % of requests complete "
               "(`bench/slo_rate.py`); the bounds are what the steps either side allow. "
               f"The field study reports {doc.get('field_study_ratio', 2.9)}x req/s at the same "
               "SLO for continuous batching with instance groups over dynamic batching; "
               "`dynamic/pool` is that baseline (one undivided pool of the same workers), "
               "`dynamic` the policy alone inside the instance groups.")  # fmt: skip
    found = policies_bench.field_comparison(doc["results"])
    if found is not None:
        out.append(field_sentence(found))
    if report_plots.policies(doc, png):
        out.append(f"![policies]({png.name})")
    return out


def section_golden(doc: Doc, png: Path) -> list[str]:
    s = doc["set"]
    out = [f"{s['prompts']} prompts, {s['domains']} domains, {s['adversarial_share']:.0%} adversarial; "
           f"references {', '.join(s['reference_model'])} ({s.get('reference_generator')}); served "
           f"{s['served_model']} — same checkpoint: {s['same_checkpoint']}. "
           f"References with no words (blank answers): {s.get('references_without_words', '?')}. "
           f"Bar: EM > {doc['bar']['exact_match']:.0%}, ROUGE-L > {doc['bar']['rouge_l']:.0%}."]  # fmt: skip
    rows = []
    for policy, by_kv in doc["results"].items():
        for kv, r in by_kv.items():
            if "status" in r:
                rows.append([policy, kv, r["status"], None, None, None, None, None])
                continue
            rows.append([policy, kv, r["exact_match"], r["rouge_l"], r["clean"].get("exact_match"),
                         r["adversarial"].get("exact_match"), r["errors"], r["meets_bar"]])  # fmt: skip
    out.append(table(["policy", "KV dtype", "EM", "ROUGE-L", "EM clean", "EM adversarial",
                      "errors", "meets bar"], rows))  # fmt: skip
    misses = [
        m
        for by_kv in doc["results"].values()
        for r in by_kv.values()
        for m in r.get("mismatches", [])
    ]
    if misses:
        out.append(
            "First mismatches: "
            + "; ".join(f"`{m['id']}` at char {m['diverges_at_char']}" for m in misses[:8])
        )
    if report_plots.golden(doc, png):
        out.append(f"![golden]({png.name})")
    return out


def section_serve(doc: Doc, png: Path) -> list[str]:
    r = doc.get("result", {})
    if "request_throughput" not in r:
        return generic(doc)
    return [f"Mode `{doc.get('mode')}`, target {doc.get('target')}.",
            table(["completed", "failed", "req/s", "out tok/s", "TTFT p50/p99 ms", "E2E p50/p99 ms"],
                  [[r["completed"], r["failed"], r["request_throughput"], r["output_throughput"],
                    f"{r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p99']:.0f}",
                    f"{r['e2e_ms']['p50']:.0f} / {r['e2e_ms']['p99']:.0f}"]])]  # fmt: skip


def section_replicas(doc: Doc, png: Path) -> list[str]:
    r = doc.get("result", {})
    if "per_count" not in r:
        return generic(doc)
    # Results stored before the ramp's retries were reported get them from their steps.
    max_p99 = doc.get("config", {}).get("max_p99_ms", 500.0)
    ramps = {ramp["replicas"]: ramp["steps"] for ramp in doc.get("ramps", [])}
    rows = []
    for c in r["per_count"]:
        steps = ramps.get(c["replicas"], [])
        retried = c.get("top_step_was_a_retry", top_step_was_a_retry(steps, max_p99))
        first_try = c.get("max_sustained_rps_without_retries") or (
            without_retries(steps, max_p99) if steps else "-"
        )
        rows.append([
            c["replicas"], f"{c['max_sustained_rps']:.0f}" + (" (on a retry)" if retried else ""),
            first_try, c["vs_one_replica"], c["scaling_efficiency"],
            c["share_of_device_bound"],
            ", ".join(f"{n} {u:.2f}" for n, u in sorted(
                c["cpu_util_at_top_step"].items(), key=lambda kv: -kv[1])[:3]),
        ])  # fmt: skip
    head = ["replicas", "req/s within SLO", "without retries", "x one", "efficiency",
            "of device bound", "busiest (cores)"]  # fmt: skip
    return [
        f"Device bound per replica (cost model): {r['device_bound_rps_per_replica']} req/s. "
        "A step that misses is run once more before the ramp stops (one burst of other "
        'work on a shared machine can fail a step); "on a retry" marks a figure whose step '
        'passed only the second time, and "without retries" is where the ramp would have '
        "stopped at its first miss.",
        table(head, rows),
    ]


def section_engine(doc: Doc, png: Path) -> list[str]:
    if "policies" not in doc:
        return generic(doc)
    rel = doc.get("ratios_vs_static", {})
    rows = [[p, r.get("output_tok_s"), r.get("req_s"), r.get("mean_ttft_ms"), r.get("mean_tpot_ms"),
             rel.get(p, {}).get("output_tok_s")] for p, r in doc["policies"].items()]  # fmt: skip
    return [
        table(["policy", "out tok/s", "req/s", "mean TTFT ms", "mean TPOT ms", "x static"], rows)
    ]


def section_locust(doc: Doc, png: Path) -> list[str]:
    head = [doc["summary"]] if doc.get("summary") else []
    by_request = doc.get("result", {}).get("by_request")
    if by_request:  # the run's own rows (a CSV named by a bare file name was another run's)
        rows = [[*key.split(" ", 1), v["requests"], v["failures"], v["p50_ms"], v["p95_ms"],
                 v["p99_ms"]] for key, v in by_request.items()]  # fmt: skip
    else:
        # Locust's "Aggregated" row pools requests with the TTFT/ITL timing events and the
        # invalid requests' 4xx answers: its percentiles describe nothing, so it is left out.
        rows = [[r["Type"], r["Name"], r["Request Count"], r["Failure Count"],
                 r["Median Response Time"], r.get("95%"), r.get("99%")]
                for r in doc.get("rows", []) if r["Name"] != "Aggregated"]  # fmt: skip
    return [
        *head,
        table(["type", "name", "requests", "failures", "median ms", "p95 ms", "p99 ms"], rows),
    ]


def generic(doc: Doc, limit: int = 24) -> list[str]:
    """Scalar figures of an unknown layout, as ``a.b.c = value`` lines."""
    lines: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        if len(lines) >= limit:
            return
        if isinstance(node, dict):
            for key, value in node.items():
                if key not in ("command", "machine", "config", "argv", "note"):
                    walk(value, f"{prefix}.{key}" if prefix else str(key))
        elif isinstance(node, int | float | str | bool) and len(str(node)) < 80:
            lines.append(f"- `{prefix}` = {node}")

    walk(doc, "")
    return lines or ["(no scalar figures)"]


def section_kvquant(doc: Doc, png: Path) -> list[str]:
    """Each quantised KV's drop against its model dtype's own KV, with its interval, real
    runs then simulated schemes: the headline of bench.kvquant, past the generic lines'
    limit before."""
    if "golden" not in doc:
        return generic(doc)

    def drop(entry: Doc, key: str) -> str:
        d = entry.get("drop", {}).get(key)
        return f"{d['points']:.2f} [{d['ci95_low']:.2f}, {d['ci95_high']:.2f}]" if d else "-"

    bar = doc.get("target_drop_points", 1)

    def met(entry: Doc) -> str:  # bench.kvquant.target's strict reading: whole intervals
        drops = entry.get("drop", {}).values()
        return "yes" if drops and all(d["ci95_high"] < bar for d in drops) else "no"

    rows = [
        [model, kv, drop(g, "exact_match"), drop(g, "rouge_l"),
         drop(doc["agreement"].get(model, {}).get(kv, {}), "exact_match"), met(g)]
        for model, by_kv in doc["golden"].items() for kv, g in by_kv.items() if kv != "auto"
    ]  # fmt: skip
    for name, entry in (doc.get("simulated_schemes") or {}).items():
        rows.append(["float32 (simulated)", name, drop(entry["golden"], "exact_match"),
                     drop(entry["golden"], "rouge_l"), drop(entry["agreement"], "exact_match"),
                     met(entry["golden"])])  # fmt: skip
    head = ["model", "KV", "golden EM drop", "golden ROUGE-L drop", "agreement EM drop",
            "golden under the bar"]  # fmt: skip
    return [
        f"Drops in points against the same model's unquantised KV, [95 % interval]; "
        f"the bar: under {bar:g} point, the whole interval included.",
        table(head, rows),
    ]


SECTIONS: dict[str, Callable[[Doc, Path], list[str]]] = {
    "policies": section_policies,
    "golden": section_golden,
    "serve": section_serve,
    "replicas": section_replicas,
    "engine": section_engine,
    "locust": section_locust,
    "kvquant": section_kvquant,
}


# --- the report ------------------------------------------------------------------------------


def this_machine() -> str:
    """The machine building the report (where the results usually came from too)."""
    cpu = ""
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    try:
        mem_kb = next(
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        )
        mem = f"{mem_kb / 2**20:.0f} GiB"
    except (OSError, StopIteration):
        mem = "?"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{platform.platform()}; Python {platform.python_version()}; {os.cpu_count()} CPUs "
            f"({cpu or platform.processor() or '?'}); {mem} memory; load average {load}")  # fmt: skip


def part(folder: Path, title: str) -> list[str]:
    """The report's part for one results folder."""
    found = collect(folder)
    out = [f"## {title}", ""]
    machines = {
        json.dumps(d["machine"], sort_keys=True)
        for docs in found.values()
        for _, d in docs
        if isinstance(d.get("machine"), dict)
    }
    for m in sorted(machines):
        out.append(f"- machine (from the results): `{m}`")
    out.append("")
    for kind in [*KNOWN, *sorted(set(found) - set(KNOWN))]:
        docs = found.get(kind)
        if not docs:
            out += [
                f"### {kind}",
                "",
                f"No result in `{folder.name}/` (run `{DEFAULT_COMMANDS.get(kind, '?')}`).",
                "",
            ]
            continue
        for path, doc in docs:
            out += [f"### {kind} — `{path.name}`", ""]
            command = doc.get("command")
            # Without one, say so: the default command beside a run made otherwise (a GPU
            # --fixed-batch engine run) misled.
            out.append(f"Command: `{command}`" if command else "Command: not recorded in the file.")
            out.append("")
            if isinstance(doc.get("note"), str):  # a caveat written into the file afterwards
                out += [f"Note: {doc['note']}", ""]
            try:
                body = SECTIONS.get(kind, lambda d, _p: generic(d))(
                    doc, folder / f"{path.stem}.png"
                )
            except (KeyError, TypeError, ValueError) as exc:
                body = [f"(layout not understood: {exc!r}; its scalars:)", *generic(doc)]
            for block in body:  # Markdown needs a blank line around tables and images
                out += [block, ""]
        for png in sorted(folder.glob("*.png")):
            if not any(png.stem == p.stem for p, _ in docs) and png.stem.startswith(kind):
                out += [f"![{png.stem}]({png.name})", ""]
    return out


def build(results: Path) -> Path:
    """Write ``results/REPORT.md``; returns its path."""
    folders = [results] if list(results.glob("*.json")) or list(results.glob("*.csv")) else []
    folders += sorted(p for p in results.iterdir() if p.is_dir())
    lines = [
        "# qosserve benchmark report",
        "",
        f"Built by `python -m bench.report` on: {this_machine()}.",
        "",
    ]
    if not folders:
        lines.append(f"No results in `{results}`.")
    for folder in folders:
        lines += part(folder, f"{folder.name} results")
    # Images live next to the JSON they come from: link them relative to REPORT.md.
    text = "\n".join(lines) + "\n"
    for folder in folders:
        if folder != results:
            for png in folder.glob("*.png"):
                text = text.replace(f"]({png.name})", f"]({folder.name}/{png.name})")
    out = results / "REPORT.md"
    out.write_text(text)
    return out


# field_comparison's met: True, False, or None when the bracket straddles the target.
VERDICT = {True: "met", False: "not met", None: "undecided: the bracket straddles the target"}


def field_sentence(found: dict[str, Any]) -> str:
    """The field-study comparison (``policies.field_comparison``) as one sentence."""
    ratio = found["slo_rate_ratio"]
    shown = (f"{ratio:.3g}x" if ratio is not None
             else f"at least {found['slo_rate_ratio_low']:.3g}x (the pool missed at every step)")  # fmt: skip
    return (f"Field-study comparison: `{found['policy']}` with instance groups holds the SLO "
            f"at {shown} the rate `dynamic/pool` does (target {found['target']}x: "
            f"{VERDICT[found['met']]}).")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.report", description=__doc__.split("\n")[0])
    p.add_argument("--results", default=str(RESULTS), help="folder of result JSON files")
    args = p.parse_args(argv)
    results = Path(args.results)
    if not results.is_dir():
        print(f"bench.report: no folder {results}", file=sys.stderr)
        return 2
    print(build(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
