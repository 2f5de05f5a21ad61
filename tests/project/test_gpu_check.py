"""``make gpu-check`` on a machine without CUDA, and the parts of scripts/gpu_check/ that need no GPU.

The GPU run itself happens only on a GPU machine; here: the one-line exit on a CPU machine, the
wheel folder handling (split wheels joined, a missing half reported, the machine's torch never
replaced), the metadata fallback for the checkout, which files hold GPU tests, and the summary
(JSON + Markdown table) built from a fabricated pytest report, measured records and benchmark JSON.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check"  # a package, run as a folder: python scripts/gpu_check
MARK = "pytest.mark." + "gpu"  # spelled apart so that this file is not taken for a GPU test file


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    """The package, imported from scripts/ (not on sys.path otherwise), with its step modules loaded."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(SCRIPT.parent))
        package = importlib.import_module("gpu_check")
        for step in ("cuda", "wheels", "install", "run", "report"):
            importlib.import_module(f"gpu_check.{step}")
    return package


# --------------------------------------------------------------------------- without CUDA


@pytest.mark.skipif(_cuda(), reason="on a GPU machine this would run the whole check")
def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "out")],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA"), proc.stdout
    assert proc.stderr == ""
    assert not (tmp_path / "out").exists(), "nothing is installed or written without a GPU"


@pytest.mark.skipif(_cuda() or shutil.which("make") is None, reason="needs make and no GPU")
def test_make_gpu_check_without_cuda() -> None:
    proc = subprocess.run(
        ["make", "--no-print-directory", "gpu-check", f"PYTHON={sys.executable}", "WHEELS=/nonexistent-wheels"],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [proc.stdout.strip()] and "no CUDA" in proc.stdout, proc.stdout


def test_no_cuda_line(gpu_check: ModuleType) -> None:
    assert (
        gpu_check.cuda.no_cuda_line({"error": "torch is not importable: ModuleNotFoundError: torch"})
        == "gpu-check: no CUDA here (torch is not importable: ModuleNotFoundError: torch): nothing to check"
    )
    assert "CPU-only build" in gpu_check.cuda.no_cuda_line({"torch": "2.13.0+cpu", "cuda_build": None, "cuda": False})
    assert "CUDA 12.8 build" in gpu_check.cuda.no_cuda_line({"torch": "2.11.0", "cuda_build": "12.8", "cuda": False})
    assert gpu_check.cuda.no_cuda_line({"torch": "2.11.0", "cuda_build": "13.0", "cuda": True, "count": 1}) is None


# --------------------------------------------------------------------------- wheels


def _wheel(folder: Path, dist: str, version: str, tag: str = "py3-none-any", size: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr(f"{dist}/__init__.py", "x = 1\n" + "#" * size)
        z.writestr(f"{dist}-{version}.dist-info/METADATA", f"Name: {dist}\nVersion: {version}\n")
    return path


def _split(path: Path, first: Path, second: Path) -> None:
    data = path.read_bytes()
    first.mkdir(parents=True, exist_ok=True)
    second.mkdir(parents=True, exist_ok=True)
    (first / f"{path.name}.part-aa").write_bytes(data[: len(data) // 2])
    (second / f"{path.name}.part-ab").write_bytes(data[len(data) // 2 :])
    path.unlink()


def test_split_wheels_are_joined_and_a_missing_half_is_reported(gpu_check: ModuleType, tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    big = _wheel(tmp_path / "staging", "ray", "2.60.0", "cp312-cp312-manylinux2014_x86_64", size=50_000)
    _split(big, wheels / "call1", wheels / "call2")  # the halves came in two transfers
    half = _wheel(tmp_path / "staging", "megatron_core", "0.16.1", "cp312-cp312-manylinux_2_28_x86_64", size=20_000)
    _split(half, wheels / "call1", tmp_path / "never-sent")
    _wheel(wheels, "pydantic", "2.14.3")
    _wheel(wheels, "pydantic", "2.9.0")
    _wheel(wheels, "torch", "2.13.0", "cp312-cp312-manylinux_2_28_x86_64")
    _wheel(wheels, "nvidia_nccl_cu12", "2.27.0", "py3-none-manylinux2014_x86_64")

    found, notes = gpu_check.wheels.collect_wheels([wheels, tmp_path / "nope"], tmp_path / "joined")
    names = [p.name for p in found]
    assert names == ["pydantic-2.14.3-py3-none-any.whl", "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl"]
    joined = next(p for p in found if p.name.startswith("ray"))
    with zipfile.ZipFile(joined) as z:
        assert z.testzip() is None and "ray/__init__.py" in z.namelist()
    text = "\n".join(notes)
    assert "megatron_core-0.16.1" in text and "part is missing" in text
    assert "nope does not exist" in text
    assert "pydantic-2.9.0-py3-none-any.whl: left out (pydantic-2.14.3-py3-none-any.whl is newer)" in text
    assert "torch-2.13.0" in text and "nvidia_nccl" in text and "machine's own" in text


def test_installed_newer_versions_are_kept(gpu_check: ModuleType, tmp_path: Path) -> None:
    wheels = [
        _wheel(tmp_path, "pydantic", "2.14.3"),
        _wheel(tmp_path, "typing_extensions", "4.16.0"),
        _wheel(tmp_path, "ray", "2.60.0"),
    ]
    have = {"pydantic": None, "typing-extensions": "4.12.2", "ray": "2.60.0"}
    chosen, notes = gpu_check.wheels.wheels_to_install(wheels, installed=have.get)
    assert [p.name.split("-")[0] for p in chosen] == ["pydantic", "typing_extensions"]
    assert notes == ["ray: 2.60.0 already installed (wheel 2.60.0 not needed)"]


def test_metadata_shim_makes_the_checkout_discoverable(gpu_check: ModuleType, tmp_path: Path) -> None:
    projects = [ROOT, *gpu_check.install.plugin_dirs()]
    gpu_check.install.write_metadata_shim(tmp_path / "site", projects)
    dists = {d.metadata["Name"]: d for d in importlib.metadata.distributions(path=[str(tmp_path / "site")])}
    assert {"rlcore", "rl-dtensor", "rl-fsdp1", "rl-megatron", "rl-vllm"} <= set(dists)
    plugins = {ep.name: ep.value for d in dists.values() for ep in d.entry_points if ep.group == "rlcore.plugins"}
    assert plugins["dtensor"] == "rl_dtensor.plugin" and plugins["megatron"] == "rl_megatron.plugin"
    assert any(ep.group == "console_scripts" and ep.name == "rlcore" for ep in dists["rlcore"].entry_points)


def test_gpu_test_files(gpu_check: ModuleType, tmp_path: Path) -> None:
    files = [str(p.relative_to(ROOT)) for p in gpu_check.run.gpu_test_files()]
    assert "tests/backends/test_backends_gpu.py" in files and "plugins/rl-megatron/tests/test_megatron_gpu.py" in files
    assert "tests/project/test_gpu_check.py" not in files and "tests/support/support_gpu.py" not in files
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(f"import pytest\npytestmark = {MARK}\n")
    (tmp_path / "tests" / "test_b.py").write_text("def test_x(): pass\n")
    assert [p.name for p in gpu_check.run.gpu_test_files(tmp_path)] == ["test_a.py"]


# --------------------------------------------------------------------------- the summary

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="2" tests="6" time="98.7">
<testcase classname="tests.backends.test_backends_gpu" name="test_fp32_logprobs_match_hf_float64[dtensor]"
          file="tests/backends/test_backends_gpu.py" line="190" time="31.25"/>
<testcase classname="tests.backends.test_backends_gpu" name="test_cuda_ipc_refit_into_another_process[fsdp1]"
          file="tests/backends/test_backends_gpu.py" line="340" time="12.0">
  <failure message="AssertionError: round 1: receiver logprobs differ from the policy's by 0.031">trace</failure>
</testcase>
<testcase classname="tests.backends.test_backends_gpu" name="test_fp32_logprobs_match_hf_float64[megatron]"
          file="tests/backends/test_backends_gpu.py" line="190" time="0.01">
  <skipped type="pytest.skip" message="megatron-core is not installed">skip</skipped>
</testcase>
<testcase classname="test_dtensor_gpu" name="test_context_parallel_is_refused_clearly_on_gpus" time="0.0">
  <skipped type="pytest.skip" message="needs 2 GPUs">skip</skipped>
</testcase>
<testcase classname="tests.distributed.test_cuda_runtime_gpu" name="test_cpu_cluster_on_a_gpu_machine_stays_on_cpu"
          file="tests/distributed/test_cuda_runtime_gpu.py" time="20.5">
  <error message="failed on setup with &quot;RuntimeError: boom | bad&quot;">trace</error>
</testcase>
<testcase classname="tests.distributed.test_cuda_runtime_gpu" name="test_one_rank_nccl_groups_from_rlcore_rendezvous"
          file="tests/distributed/test_cuda_runtime_gpu.py" time="6.5"/>
</testsuite></testsuites>
"""

BENCH = {
    "gpu": "NVIDIA H100 80GB HBM3",
    "peak_bf16_tflops": 989.4,
    "torch": "2.11.0+cu130",
    "presets": {
        "0.5b": {
            "params": 494032768,
            "seq": 2048,
            "batch": 8,
            "tokens_per_step": 16384,
            "raw": {"step_s": 0.21, "tflops": 272.5, "mfu": 0.275, "peak_gb": 21.3, "theory_gb": 23.8},
            "dtensor": {
                "step_s": 0.23,
                "tflops": 248.8,
                "mfu": 0.251,
                "vs_raw": 1.095,
                "peak_gb": 22.9,
                "theory_gb": 23.8,
                "refit": {
                    "bytes": 988065536,
                    "refit_s": 0.05,
                    "refit_gb_s": 19.8,
                    "d2d_gb_s": 1450.0,
                    "refit_vs_d2d": 73.2,
                },
            },
            "megatron": {"skipped": "megatron-core is not installed"},
        },
        "1b": {"skipped": "time budget"},
    },
}


def test_summary_and_table_from_a_pytest_report(gpu_check: ModuleType, tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    tests = gpu_check.report.parse_junit(junit)
    assert tests["counts"] == {"passed": 2, "failed": 1, "error": 1, "skipped": 2}
    ids = [c["id"] for c in tests["cases"]]
    assert ids[0] == "tests/backends/test_backends_gpu.py::test_fp32_logprobs_match_hf_float64[dtensor]"
    assert ids[3] == "plugins/rl-dtensor/tests/test_dtensor_gpu.py::test_context_parallel_is_refused_clearly_on_gpus"
    assert tests["cases"][1]["message"].startswith("AssertionError: round 1")

    records_file = tmp_path / "records.jsonl"
    records_file.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {
                    "test": ids[0],
                    "name": "fp32_logprobs_vs_hf_f64_max_abs",
                    "value": 3.2e-7,
                    "backend": "dtensor",
                    "tolerance": 1e-5,
                },
                {"test": ids[1], "name": "ipc_refit_receiver_vs_policy_max_abs", "value": 0.031, "round": 1},
            ]
        )
        + "\nnot json\n"
    )
    records = gpu_check.report.read_records(records_file)
    assert len(records) == 2
    machine = {
        "name": "NVIDIA H100 80GB HBM3",
        "memory_gb": 79.2,
        "capability": "9.0",
        "count": 1,
        "torch": "2.11.0+cu130",
        "cuda_build": "13.0",
        "nccl": "2.27.7",
        "python": "3.12.3",
    }
    setup = {
        "problems": [],
        "wheels_installed": ["ray-2.60.0-cp312.whl"],
        "checkout": "pip install -e",
        "imports": {"ray": {"ok": True}, "megatron.core": {"ok": False, "error": "ModuleNotFoundError"}},
    }
    summary = gpu_check.report.summarize(
        machine,
        setup,
        tests,
        records,
        BENCH,
        {"install": 20.0, "tests": 300.0, "benchmark": 200.0, "total": 521.0},
        ["a note"],
    )
    assert summary["status"] == "failed" and summary["missing"] == ["megatron.core"]
    json.dumps(summary)  # the JSON file is written from this

    table = gpu_check.report.render_markdown(summary)
    assert table.startswith("### `make gpu-check`") and "**failed**" in table
    assert "NVIDIA H100 80GB HBM3 (79.2 GiB, sm 9.0, 1 GPU), torch 2.11.0+cu130" in table
    assert "| tests | 2 passed, 1 failed, 1 errors, 2 skipped | 300 |" in table
    assert "| missing | megatron.core (their checks are skipped) | |" in table
    row = next(ln for ln in table.splitlines() if "fp32_logprobs_match_hf_float64[dtensor]" in ln)
    assert "| passed | 31.2 |" in row or "| passed | 31.3 |" in row
    assert "fp32_logprobs_vs_hf_f64_max_abs 3.2e-07 (tol 1e-05) [backend dtensor]" in row
    failed = next(ln for ln in table.splitlines() if "refit_into_another_process[fsdp1]" in ln)
    assert "| failed |" in failed and "receiver logprobs differ" in failed
    error = next(ln for ln in table.splitlines() if "stays_on_cpu" in ln)
    assert "RuntimeError: boom / bad" in error and error.count("|") == 5  # a '|' in a message cannot break the row
    assert "| 0.5b | 2048 x 8 | dtensor | 0.230 | 248.8 | 0.251 | 1.095 | 22.9 | 23.8 |" in table
    assert "| 0.5b | 2048 x 8 | megatron | megatron-core is not installed |" in table
    assert "| 1b | | | time budget |" in table
    assert "| 0.5b | dtensor | 0.99 | 0.05 | 19.8 | 1450.0 | 73.2x |" in table
    assert table.rstrip().endswith("- a note")


def test_summary_status(gpu_check: ModuleType) -> None:
    ok = {"counts": {"passed": 3, "failed": 0, "error": 0, "skipped": 1}, "cases": []}
    imports_ok = {"imports": {"ray": {"ok": True}, "megatron.core": {"ok": True}}, "problems": []}
    bench_ok = {"presets": {"0.5b": {"raw": {"step_s": 1.0}}}}
    assert gpu_check.report.summarize({}, imports_ok, ok, [], bench_ok, {}, [])["status"] == "passed"
    assert gpu_check.report.summarize({}, imports_ok, ok, [], None, {}, [])["status"] == "incomplete"
    no_ray = {"imports": {"ray": {"ok": False}}, "problems": []}
    assert gpu_check.report.summarize({}, no_ray, ok, [], bench_ok, {}, [])["status"] == "incomplete"
    bench_error = {"presets": {"0.5b": {"dtensor": {"error": "WorkerError: CUDA out of memory"}}}}
    assert gpu_check.report.summarize({}, imports_ok, ok, [], bench_error, {}, [])["status"] == "failed"
    leaked = dict(ok, leaks=["process 77 raylet"])
    assert gpu_check.report.summarize({}, imports_ok, leaked, [], bench_ok, {}, [])["status"] == "failed"
    timed_out = dict(ok, timed_out=True)
    assert gpu_check.report.summarize({}, imports_ok, timed_out, [], bench_ok, {}, [])["status"] == "failed"
    broken = {"imports": {}, "problems": ["cannot import pydantic: ModuleNotFoundError"]}
    summary = gpu_check.report.summarize({}, broken, {"cases": [], "counts": {}, "error": "not run"}, [], None, {}, [])
    assert summary["status"] == "setup failed"
    assert "problems: cannot import pydantic" in gpu_check.report.render_markdown(summary)


def test_benchmark_result_is_the_last_json_line(gpu_check: ModuleType) -> None:
    text = f'table\n{json.dumps(BENCH)}\n(raylet) {{not json\n{{"other": 1}}\n'
    assert gpu_check.report.last_json(text) == BENCH
    assert gpu_check.report.last_json("no result\n") is None


def test_leak_lines(gpu_check: ModuleType) -> None:
    log = (
        "...\nleak check: the test session left these behind:\n  shared memory /dev/shm/torch_1_2\n"
        "  process 77 raylet\n(shared memory and temp entries of other runs ...)\n"
    )
    assert gpu_check.report.leak_lines(log) == ["shared memory /dev/shm/torch_1_2", "process 77 raylet"]
    assert gpu_check.report.leak_lines("all good") == []
