"""Step 6 of ``make gpu-check``: what the runs left (junit report, measured records, benchmark JSON,
leak check) read back, the status decided, and the ``summary.md`` table rendered."""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from .common import OPTIONAL, ROOT

# --------------------------------------------------------------------------- reading the runs' output


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and one row per test case of a pytest ``--junitxml`` report."""
    if not path.exists():
        return {"error": f"no report at {path}", "cases": [], "counts": {}}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    cases = []
    for suite in suites:
        for case in suite.iter("testcase"):
            outcome, message = "passed", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                    message = (child.get("message") or (child.text or "")).strip()
                    break
            classname, name = case.get("classname", ""), case.get("name", "")
            cases.append(
                {
                    "id": _test_id(classname, name, case.get("file")),
                    "outcome": outcome,
                    "seconds": round(float(case.get("time") or 0.0), 2),
                    "message": _one_line(message),
                }
            )
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    return {"cases": cases, "counts": counts, "seconds": round(sum(float(s.get("time") or 0.0) for s in suites), 1)}


def _test_id(classname: str, name: str, file: str | None) -> str:
    """``path/to/test_file.py::name`` from junit's dotted classname (``tests.test_x`` / ``test_x.Class``)."""
    if file:
        return f"{file}::{name}"
    parts = classname.split(".")
    for split in range(len(parts), 0, -1):
        candidate = "/".join(parts[:split]) + ".py"
        matches = (
            [candidate]
            if (ROOT / candidate).exists()
            else [str(p.relative_to(ROOT)) for p in ROOT.glob(f"plugins/*/tests/{candidate}")]
        )
        if matches:
            return "::".join([matches[0], *parts[split:], name])
    return f"{classname}::{name}" if classname else name


def _one_line(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def last_json(text: str) -> dict[str, Any] | None:
    """The benchmark's result: the last line that is a JSON object (Ray may log after it)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict) and ("presets" in value or "skipped" in value):
                return value
    return None


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def leak_lines(log_text: str) -> list[str]:
    """What the suite's leak check reported (conftest.py), if anything."""
    lines = log_text.splitlines()
    for i, line in enumerate(lines):
        if "leak check: the test session left these behind" in line:
            return [ln.strip() for ln in lines[i + 1 :] if ln.startswith("  ")][:20]
    return []


# --------------------------------------------------------------------------- summary


def summarize(
    env_info: dict,
    setup: dict,
    tests: dict,
    records: list[dict],
    bench: dict | None,
    timings: dict[str, float],
    notes: list[str],
) -> dict[str, Any]:
    counts = tests.get("counts", {})
    failed = counts.get("failed", 0) + counts.get("error", 0)
    missing = [m for m, info in setup.get("imports", {}).items() if m in OPTIONAL and not info.get("ok")]
    bench_ok = bench is not None and "error" not in bench and not _bench_errors(bench)
    if setup.get("problems") and not counts:
        status = "setup failed"
    elif (
        failed
        or tests.get("error")
        or tests.get("timed_out")
        or tests.get("leaks")
        or (bench is not None and not bench_ok)
    ):
        status = "failed"
    elif missing or bench is None:
        status = "incomplete"
    else:
        status = "passed"
    return {
        "status": status,
        "machine": env_info,
        "setup": setup,
        "tests": tests,
        "records": records,
        "benchmark": bench,
        "seconds": timings,
        "missing": missing,
        "notes": notes,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def _bench_errors(bench: dict) -> list[str]:
    out = []
    for preset, entry in (bench.get("presets") or {}).items():
        if "error" in entry:
            out.append(f"{preset}: {entry['error']}")
        for side, row in entry.items():
            if isinstance(row, dict) and "error" in row:
                out.append(f"{preset} {side}: {row['error']}")
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    return str(value)


def render_markdown(summary: dict[str, Any]) -> str:
    m = summary.get("machine", {})
    tests = summary.get("tests", {})
    counts = tests.get("counts", {})
    machine = (
        f"{m.get('name', '?')} ({m.get('memory_gb', '?')} GiB, sm {m.get('capability', '?')}, "
        f"{m.get('count', '?')} GPU), torch {m.get('torch', '?')} (CUDA {m.get('cuda_build', '?')}, "
        f"NCCL {m.get('nccl', '?')}), Python {m.get('python', '?')}."
    )
    lines = [f"### `make gpu-check`, {summary.get('date')}: **{summary['status']}**", "", machine, ""]
    secs = summary.get("seconds", {})
    lines += ["| step | result | s |", "| --- | --- | --- |"]
    setup = summary.get("setup", {})
    lines.append(
        f"| install | {setup.get('checkout', '-')}; {len(setup.get('wheels_installed', []))} wheel(s)"
        f"{'; problems: ' + '; '.join(setup['problems']) if setup.get('problems') else ''} | "
        f"{secs.get('install', 0):.0f} |"
    )
    if summary.get("missing"):
        lines.append(f"| missing | {', '.join(summary['missing'])} (their checks are skipped) | |")
    lines.append(
        f"| tests | {counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, "
        f"{counts.get('error', 0)} errors, {counts.get('skipped', 0)} skipped"
        f"{' (timed out)' if tests.get('timed_out') else ''}{'; ' + tests['error'] if tests.get('error') else ''}"
        f" | {secs.get('tests', 0):.0f} |"
    )
    if tests.get("leaks"):
        lines.append(f"| leak check | {'; '.join(tests['leaks'][:5])} | |")
    bench = summary.get("benchmark")
    bench_state = "not run" if bench is None else ("error: " + bench["error"] if "error" in bench else "ran")
    lines.append(f"| benchmarks/gpu.py | {bench_state} | {secs.get('benchmark', 0):.0f} |")
    lines.append(f"| total | | {secs.get('total', 0):.0f} |")

    records: dict[str, list[str]] = {}
    for r in summary.get("records", []):
        extra = {k: v for k, v in r.items() if k not in ("test", "name", "value", "tolerance")}
        tol = f" (tol {_fmt(r['tolerance'])})" if "tolerance" in r else ""
        records.setdefault(r.get("test", ""), []).append(
            f"{r['name']} {_fmt(r['value'])}{tol}" + (f" [{_fmt(extra)}]" if extra else "")
        )
    lines += ["", "| test | outcome | s | measured / reason |", "| --- | --- | --- | --- |"]
    for case in tests.get("cases", []):
        measured = "; ".join(records.get(case["id"], [])) or case.get("message", "")
        if case["outcome"] in ("failed", "error") and case.get("message"):
            measured = case["message"] + ("; " + measured if measured != case["message"] else "")
        lines.append(f"| `{case['id']}` | {case['outcome']} | {case['seconds']:.1f} | {measured.replace('|', '/')} |")

    if bench and "presets" in bench:
        lines += [
            "",
            f"Benchmark (`benchmarks/gpu.py`), dense bf16 peak {bench.get('peak_bf16_tflops')} TFLOP/s:",
            "",
            "| preset | S x batch | side | step s | TFLOP/s | MFU | vs raw | peak GB | theory GB |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        refits = []
        for preset, entry in bench["presets"].items():
            shape = f"{entry.get('seq', '?')} x {entry.get('batch', '?')}"
            for side in ("raw", "dtensor", "dtensor-regather", "megatron"):
                row = entry.get(side)
                if not isinstance(row, dict):
                    continue
                if "step_s" not in row:
                    lines.append(
                        f"| {preset} | {shape} | {side} | {row.get('error') or row.get('skipped')} | | | | | |"
                    )
                    continue
                lines.append(
                    f"| {preset} | {shape} | {side} | {row['step_s']:.3f} | {row['tflops']} | "
                    f"{row.get('mfu') if row.get('mfu') is not None else '-'} | {row.get('vs_raw', '-')} | "
                    f"{row['peak_gb']} | {row.get('theory_gb', '-')} |"
                )
                if row.get("refit"):
                    refits.append((preset, side, row["refit"]))
            if "error" in entry or "skipped" in entry:
                lines.append(f"| {preset} | | | {entry.get('error') or entry.get('skipped')} | | | | | |")
        if refits:
            lines += [
                "",
                "| preset | refit from | GB | refit s | GB/s | device copy GB/s | refit / copy |",
                "| --- | --- | --- | --- | --- | --- | --- |",
            ]
            for preset, side, r in refits:
                lines.append(
                    f"| {preset} | {side} | {r['bytes'] / 1e9:.2f} | {r['refit_s']} | {r['refit_gb_s']} | "
                    f"{r['d2d_gb_s']} | {r['refit_vs_d2d']}x |"
                )
    if summary.get("notes"):
        lines += ["", *(f"- {n}" for n in summary["notes"])]
    return "\n".join(lines) + "\n"
