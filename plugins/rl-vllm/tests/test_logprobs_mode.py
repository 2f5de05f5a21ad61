"""``vllm_cfg.logprobs_mode``: processed (the sampler's distribution) against raw (the model's), on real engines.

Two in-process engines of the tiny Llama, one per mode, with the same seed, sample the same prompts at
temperature 2 (so they draw the same tokens). The reference is a float64 Hugging Face forward of the same
checkpoint: processed logprobs must be ``log_softmax(z / 2)`` at the drawn token, raw ones ``log_softmax(z)``,
and their difference what those two formulas give.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rlcore.config import load_config_dict
from rlcore.data import BatchedDataDict
from rlcore.testing.conformance import load_hf_model
from rlcore.testing.models import make_batch
from rlcore.testing.pytest_plugin import ClusterPool

#: Two engines start for the module: ~40 s idle, 2 minutes on a loaded machine.
pytestmark = pytest.mark.slow

TEMPERATURE = 2.0
MAX_NEW = 6
#: float32 engines against a float64 forward.
ATOL = 1e-4
MODES = ("processed_logprobs", "raw_logprobs")


@pytest.fixture(scope="module")
def sampled(ray_session: None, tiny_model_dir: str, tiny_tokenizer: Any) -> Iterator[dict[str, Any]]:
    from rl_vllm.generation import VllmGeneration

    raw = make_batch(tiny_tokenizer, 4, 3, 8, seed=5)
    prompts = BatchedDataDict(input_ids=raw["input_ids"], input_lengths=raw["input_lengths"])
    clusters = ClusterPool()
    engines: list[Any] = []
    outputs = {}
    try:
        for mode in MODES:
            cfg = load_config_dict(
                {
                    "cluster": {"workers_per_node": 1},
                    "policy": {
                        "model_name": tiny_model_dir,
                        "generation": {
                            "backend": "vllm",
                            "max_new_tokens": MAX_NEW,
                            "temperature": TEMPERATURE,
                            "pad_token_id": tiny_tokenizer.pad_token_id,
                            "vllm_cfg": {"kv_cache_space_gb": 0.0625, "max_model_len": 128, "logprobs_mode": mode},
                        },
                    },
                }
            ).policy
            engines.append(VllmGeneration(clusters(1), cfg.generation, name_prefix=f"logprobs-{mode}"))
            outputs[mode] = engines[-1].generate(prompts)
    finally:
        for engine in engines:
            engine.shutdown()
        clusters.shutdown()
    yield {"prompts": prompts, "outputs": outputs, "model_dir": tiny_model_dir}


def test_processed_and_raw_logprobs_differ_as_float64_says(sampled: dict[str, Any]) -> None:
    processed, raw = (sampled["outputs"][mode] for mode in MODES)
    assert torch.equal(processed["output_ids"], raw["output_ids"]), "same seed, same sampler: the same tokens"
    model = load_hf_model(sampled["model_dir"]).double().eval()
    lengths = sampled["prompts"]["input_lengths"]
    differences = []
    for i, end in enumerate(processed["unpadded_sequence_lengths"].tolist()):
        seq = processed["output_ids"][i, :end]
        with torch.no_grad():
            logits = model(seq[None]).logits[0, :-1].double()
        start, tokens = int(lengths[i]), seq[1:, None]
        want_processed = torch.log_softmax(logits / TEMPERATURE, -1).gather(1, tokens)[start - 1 :, 0]
        want_raw = torch.log_softmax(logits, -1).gather(1, tokens)[start - 1 :, 0]
        got_processed = processed["logprobs"][i, start:end].double()
        got_raw = raw["logprobs"][i, start:end].double()
        assert float((got_processed - want_processed).abs().max()) <= ATOL, "processed_logprobs: not log p(z / T)"
        assert float((got_raw - want_raw).abs().max()) <= ATOL, "raw_logprobs: not log p(z)"
        differences.append((got_processed - got_raw) - (want_processed - want_raw))
        assert float((want_processed - want_raw).abs().max()) > 1e-2, "temperature changed nothing: vacuous"
    assert float(torch.cat(differences).abs().max()) <= 2 * ATOL
