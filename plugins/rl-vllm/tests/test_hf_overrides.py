"""policy.hf_config_overrides reaches the vLLM engines (``hf_overrides``): the engine computes the model the
trainer builds with those overrides, not the checkpoint's config.

Reference: Hugging Face's model built by :func:`rlcore.training.hf_config.pretrained_model` with the same
overrides, in float64. A large ``rms_norm_eps`` changes every layer's output, so an engine that dropped the
override is far off (checked against the plain model, which must differ).
"""

from __future__ import annotations

from typing import Any

import torch

from rlcore.config import load_config_dict
from rlcore.data import BatchedDataDict
from rlcore.testing.pytest_plugin import ClusterPool

OVERRIDES = {"rms_norm_eps": 0.5}
PROMPTS = [[1, 50, 60, 70, 80], [1, 90, 91]]
MAX_NEW = 5
ATOL = 1e-4  # float32 engine against a float64 forward


def hf_logprobs(model_dir: str, overrides: dict[str, Any] | None, sequence: list[int]) -> torch.Tensor:
    from rlcore.training.hf_config import pretrained_model

    model = pretrained_model(model_dir, overrides, dtype=torch.float64)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([sequence])).logits[0], -1)


def test_the_engine_builds_the_overridden_model(ray_session: None) -> None:
    from rl_vllm.generation import VllmGeneration
    from rlcore.models import resolve_model

    model_dir = resolve_model("tiny-llama")
    policy = load_config_dict(
        {
            "cluster": {"workers_per_node": 1},
            "policy": {
                "model_name": model_dir,
                "hf_config_overrides": OVERRIDES,
                "generation": {
                    "backend": "vllm",
                    "max_new_tokens": MAX_NEW,
                    "pad_token_id": 0,
                    "vllm_cfg": {"kv_cache_space_gb": 0.0625, "max_model_len": 64},
                },
            },
        }
    ).policy
    clusters = ClusterPool()
    generation = None
    try:
        generation = VllmGeneration(
            clusters(1), policy.generation, name_prefix="overrides-vllm", hf_config_overrides=OVERRIDES
        )
        lengths = torch.tensor([len(p) for p in PROMPTS])
        ids = torch.zeros(len(PROMPTS), int(lengths.max()), dtype=torch.long)
        for i, p in enumerate(PROMPTS):
            ids[i, : len(p)] = torch.tensor(p)
        out = generation.generate(BatchedDataDict(input_ids=ids, input_lengths=lengths), greedy=True)
    finally:
        if generation is not None:
            generation.shutdown()
        clusters.shutdown()
    for i, prompt in enumerate(PROMPTS):
        n = int(out["unpadded_sequence_lengths"][i])
        seq = out["output_ids"][i, :n].tolist()
        generated = torch.tensor(seq[len(prompt) :])
        engine = out["logprobs"][i, len(prompt) : n].double()
        for overrides, should_match in ((OVERRIDES, True), (None, False)):
            rows = hf_logprobs(model_dir, overrides, seq)[len(prompt) - 1 : n - 1]
            err = float((engine - rows.gather(1, generated[:, None])[:, 0]).abs().max())
            if should_match:
                assert err <= ATOL, f"prompt {i}: the engine differs from HF with the overrides by {err:.3g}"
            else:
                assert err > 100 * ATOL, f"prompt {i}: the overrides changed nothing ({err:.3g}): the test is blind"
