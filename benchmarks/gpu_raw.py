"""The two subprocess modes of ``benchmarks/gpu.py`` that run no rlcore training code: building a preset's
model once (random weights, bf16 safetensors, cached) and the raw torch step it is measured against."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import gpu_profile
from gpu_shapes import LR, PRESETS, make_data


def cache_root() -> Path:
    base = os.environ.get("RLCORE_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "rlcore") / "bench-models"


def prepare(preset: str) -> dict:
    """Build the preset's model (random weights, bf16 safetensors) once, on the GPU; report the GPU."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from rlcore.testing.models import build_tiny_tokenizer

    kwargs = dict(PRESETS[preset])
    arch = kwargs.pop("arch")
    digest = hashlib.sha256(json.dumps([preset, kwargs, transformers.__version__], sort_keys=True).encode())
    path = cache_root() / f"{preset}-{digest.hexdigest()[:12]}"
    built = 0.0
    if not (path / "config.json").exists():
        t0 = time.perf_counter()
        tokenizer = build_tiny_tokenizer()
        config_cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[arch]
        config = config_cls(
            **kwargs,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        transformers.utils.logging.disable_progress_bar()
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))  # preflight wants a complete model directory
        try:
            os.rename(tmp, path)
        except OSError:  # another process built it first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        built = time.perf_counter() - t0
        n_params = sum(p.numel() for p in model.parameters())
        del model
    else:
        config = transformers.AutoConfig.from_pretrained(str(path))
        with torch.device("meta"):
            n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    props = torch.cuda.get_device_properties(0)
    return {
        "path": str(path),
        "params": int(n_params),
        "build_s": round(built, 1),
        "gpu": {
            "name": props.name,
            "total_bytes": int(props.total_memory),
            "capability": f"{props.major}.{props.minor}",
            "count": torch.cuda.device_count(),
        },
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def raw_step(path: str, seq: int, batch: int, mbs: int, steps: int, warmup: int, device: str = "cuda") -> dict:
    """The raw torch side: the same optimizer step without rlcore (see the module docstring).

    ``device`` is "cuda" for the measurement ("cpu" only smoke-tests this code path).
    """
    import torch
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    cuda = device.type == "cuda"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    data = make_data(model.config.vocab_size, batch, seq)
    ids, mask = data["input_ids"].to(device), data["token_mask"].to(device)
    attention = torch.ones_like(ids)
    tokens = mask[:, 1:].sum()

    def step() -> float:
        total = torch.zeros((), device=device)
        for s in range(0, batch, mbs):
            rows = slice(s, s + mbs)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(input_ids=ids[rows], attention_mask=attention[rows], use_cache=False).logits
            logits = logits[:, :-1].float()
            lp = logits.gather(-1, ids[rows, 1:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
            loss = -(lp * mask[rows, 1:]).sum() / tokens
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(total)

    losses = [step() for _ in range(warmup)]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())  # float() waits for the step
        times.append(time.perf_counter() - t0)
    out = {
        "step_s": statistics.median(times),
        "times": times,
        "losses": losses,
        "peak_bytes": int(torch.cuda.max_memory_allocated()) if cuda else 0,
    }
    if (folder := gpu_profile.profile_dir()) is not None:
        with torch.profiler.profile() as profiler:
            step()
        profiler.export_chrome_trace(str(folder / "trace_raw.json"))
        out["profile"] = gpu_profile.summarize_trace(folder / "trace_raw.json")
    return out
