"""The model presets of ``benchmarks/gpu.py`` and what follows from their shapes: model FLOPs per step,
the memory theory, the longest sequence that fits, the GPU's dense bf16 peak, and the step's data
(formulas in gpu.py's docstring)."""

from __future__ import annotations

from typing import Any

#: Hugging Face config arguments of each preset (random weights; only the shapes are the real models').
PRESETS: dict[str, dict[str, Any]] = {
    "0.5b": {
        "arch": "qwen2",
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
    },
    "1b": {
        "arch": "llama",
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
    },
}
#: Dense bf16 tensor-core peak, TFLOP/s, by a substring of the device name (first match wins).
PEAK_BF16_TFLOPS = (
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),
    ("H800", 989.4),
    ("A100", 312.0),
    ("L40S", 362.1),
)
SEQ_CANDIDATES = (8192, 4096, 2048, 1024)
MEMORY_FRACTION = 0.70
LR = 1e-5


def shape_of(preset: str) -> dict[str, int]:
    p = PRESETS[preset]
    heads = p["num_attention_heads"]
    head_dim = p.get("head_dim") or p["hidden_size"] // heads
    return {
        "layers": p["num_hidden_layers"],
        "hidden": p["hidden_size"],
        "heads": heads,
        "d_attn": heads * head_dim,
        "vocab": p["vocab_size"],
    }


def model_flops(n_params: int, shape: dict[str, int], seq: int, tokens: int) -> float:
    return 6.0 * n_params * tokens + 12.0 * shape["layers"] * shape["d_attn"] * seq * tokens


def memory_theory(backend: str, n_params: int, shape: dict[str, int], seq: int, mbs: int) -> dict[str, float]:
    static = 16.0 * n_params
    activations = 34.0 * seq * mbs * shape["hidden"] * shape["layers"]
    if backend == "megatron":
        activations += 8.0 * shape["heads"] * seq * seq * mbs * shape["layers"]
    logits = 10.0 * mbs * seq * shape["vocab"]
    return {"static": static, "activations": activations, "logits": logits, "total": static + activations + logits}


def pick_seq(backends: list[str], n_params: int, shape: dict[str, int], gpu_bytes: float) -> int:
    for seq in SEQ_CANDIDATES:
        if all(
            memory_theory(b, n_params, shape, seq, 1)["total"] <= MEMORY_FRACTION * gpu_bytes
            for b in backends + ["raw"]
        ):
            return seq
    return SEQ_CANDIDATES[-1]


def peak_tflops(device_name: str) -> float | None:
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key in device_name), None)


def make_data(vocab: int, batch: int, seq: int) -> dict:
    """Full-length rows of random token ids (no padding): every step sees ``batch * seq`` tokens."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq)
    mask[:, 0] = 0
    return {
        "input_ids": ids,
        "input_lengths": torch.full((batch,), seq),
        "token_mask": mask,
        "sample_mask": torch.ones(batch),
    }
