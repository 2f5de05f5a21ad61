"""``python3 scripts/gpu_check [options]`` (what ``make gpu-check`` runs): the steps, in order, under one budget.

See the package docstring (``__init__.py``) for what each step does and the exit statuses.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

# Run as a folder (``python3 scripts/gpu_check``), only the folder itself is on sys.path: put scripts/ first,
# so that the package imports as ``gpu_check`` (as with ``python3 -m gpu_check`` from scripts/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_check import cuda, install, report, run
from gpu_check.common import DEFAULT_OUT, log

DEFAULT_BUDGET_S = 540.0
STATUS_CODES = {"passed": 0, "failed": 1, "setup failed": 2, "incomplete": 3}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Check every CUDA path of rlcore on this machine's GPU.")
    parser.add_argument(
        "--wheels", action="append", default=[], help="folder of wheels to install first (repeatable; also $WHEELS)"
    )
    parser.add_argument("--out", default=None, help=f"where the summary and logs go (default {DEFAULT_OUT})")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="the whole run's time limit")
    parser.add_argument("--python", default=sys.executable, help="the Python with the machine's CUDA torch")
    parser.add_argument("--no-install", action="store_true", help="use what is installed as it is")
    parser.add_argument("--no-benchmark", action="store_true")
    parser.add_argument("--pytest-args", default="", help='extra pytest arguments (e.g. "-k dtensor")')
    parser.add_argument(
        "--benchmark-args",
        default="",
        help='extra benchmarks/gpu.py arguments (e.g. "--backends dtensor,dtensor-regather")',
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    deadline = start + args.budget_s

    def left() -> float:
        return deadline - time.monotonic()

    info = cuda.probe_cuda(args.python)
    line = cuda.no_cuda_line(info)
    if line is not None:
        print(line)
        return 0

    out = Path(args.out) if args.out else DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    for stale in (
        "summary.json",
        "summary.md",
        "install.log",
        "pytest.log",
        "junit.xml",
        "records.jsonl",
        "benchmark.log",
    ):
        (out / stale).unlink(missing_ok=True)
    log(
        f"{info.get('name')} x{info.get('count')}, torch {info.get('torch')} (CUDA {info.get('cuda_build')}), "
        f"Python {info.get('python')}; output in {out}"
    )
    timings: dict[str, float] = {}
    notes: list[str] = []
    setup: dict[str, Any] = {"problems": [], "wheels_installed": []}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    # 1-3. install, then check the imports
    t0 = time.monotonic()
    install_log = out / "install.log"
    install_log.write_text("")
    folders = [Path(w) for w in [*args.wheels, *filter(None, [os.environ.get("WHEELS")])]]
    if not args.no_install:
        extra_env = install.install_all(args.python, folders, install_log, left, setup, notes)
        env.update({k: os.pathsep.join(filter(None, [v, env.get(k)])) for k, v in extra_env.items()})
    else:
        setup["checkout"] = "not installed (--no-install)"
    found = install.check_imports(args.python, env)
    setup.update(found)
    timings["install"] = round(time.monotonic() - t0, 1)
    install.log_imports(found, setup)

    # 4. tests
    t0 = time.monotonic()
    keep_s = 0.0 if args.no_benchmark else run.BENCH_MIN_S
    tests = run.run_tests(args.python, out, env, found, args.pytest_args, left, keep_s)
    timings["tests"] = round(time.monotonic() - t0, 1)

    # 5. benchmark
    bench = None
    t0 = time.monotonic()
    if not args.no_benchmark and not tests.get("error"):
        bench = run.run_benchmark(args.python, out, env, left, notes, shlex.split(args.benchmark_args))
    timings["benchmark"] = round(time.monotonic() - t0, 1)
    timings["total"] = round(time.monotonic() - start, 1)

    # 6. summary
    summary = report.summarize(info, setup, tests, report.read_records(out / "records.jsonl"), bench, timings, notes)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    markdown = report.render_markdown(summary)
    (out / "summary.md").write_text(markdown)
    print(markdown)
    log(f"{summary['status']} in {timings['total']:.0f}s; {out / 'summary.md'} and summary.json written")
    return STATUS_CODES[summary["status"]]


if __name__ == "__main__":
    sys.exit(main())
