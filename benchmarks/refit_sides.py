"""``refit.py``'s measured sides: the model refitted, rlcore's refits into vLLM engines, and the engine's floor.

- :class:`Refits`: one training ``Policy`` (one rank) and, per transport, one vLLM engine and its
  ``WeightSynchronizer`` (colocated: shared memory on the rank's bundle; collective: gloo broadcast to
  an engine on its own cluster);
- :class:`InProcessEngine`: a vLLM engine in this process with the weights already in memory; its
  reload of them is the floor, and :func:`breakdown` times a colocated refit's stages in process.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

# ~134M parameters (embeddings and an untied head of a 32k vocabulary, 12 layers), ~537 MB in float32.
MODEL = dict(
    hidden_size=768,
    num_layers=12,
    num_heads=12,
    num_kv_heads=12,
    head_dim=64,
    intermediate_size=2048,
    vocab_size=32000,
    max_position_embeddings=512,
)
KV_CACHE_GB = 0.0625
TRANSPORTS = ("colocated", "collective")


def model_params(model_dir: str) -> int:
    import glob

    from safetensors import safe_open

    total = 0
    for path in glob.glob(os.path.join(model_dir, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                total += n
    return total


class Refits:
    """One training rank and, per transport asked for, one vLLM engine and its synchronizer:
    ``colocated`` shares the rank's bundle, ``collective`` sits on its own cluster."""

    def __init__(self, backend: str, model_dir: str, transports: tuple[str, ...] = TRANSPORTS) -> None:
        from rl_vllm.generation import VllmGeneration
        from rlcore.config import load_config_dict
        from rlcore.distributed import RayVirtualCluster
        from rlcore.policy import Policy
        from rlcore.refit import WeightSynchronizer
        from rlcore.testing.models import build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
        cfg = load_config_dict(
            {
                "cluster": {"workers_per_node": 1},
                "policy": {
                    "backend": backend,
                    "model_name": model_dir,
                    "precision": "float32",
                    "train_global_batch_size": 1,
                    "max_total_sequence_length": 128,
                    **(
                        {}
                        if backend == "megatron"
                        else {"optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 1e-3}}}
                    ),
                    "generation": {
                        "backend": "vllm",
                        "max_new_tokens": 8,
                        "pad_token_id": tokenizer.pad_token_id,
                        "vllm_cfg": {"kv_cache_space_gb": KV_CACHE_GB, "max_model_len": 128},
                    },
                },
            }
        ).policy
        self.clusters = [RayVirtualCluster([1], max_colocated_worker_groups=2, name="bench-train")]
        self.policy = Policy(self.clusters[0], cfg, tokenizer, init_reference_model=False)
        self.engines, self.sync = [], {}
        if "colocated" in transports:
            self.engines.append(VllmGeneration(self.clusters[0], cfg.generation, name_prefix="bench-coloc"))
            self.sync["colocated"] = WeightSynchronizer(self.policy, self.engines[-1], colocated=True)
            assert self.sync["colocated"].transport == "shared_memory"
        if "collective" in transports:
            self.clusters.append(RayVirtualCluster([1], name="bench-gen"))
            self.engines.append(VllmGeneration(self.clusters[-1], cfg.generation, name_prefix="bench-own"))
            self.sync["collective"] = WeightSynchronizer(
                self.policy, self.engines[-1], colocated=False, cluster=self.clusters[0]
            )
            assert self.sync["collective"].transport == "collective"

    def run(self, which: str) -> tuple[float, int]:
        t0 = time.perf_counter()
        stats = self.sync[which].sync_weights()
        return time.perf_counter() - t0, int(stats["bytes"])

    def close(self) -> None:
        for owner in (*self.engines, self.policy):
            owner.shutdown()
        for cluster in reversed(self.clusters):
            cluster.shutdown()


class InProcessEngine:
    """A vLLM engine in this process (no Ray, no socket) with the model's weights already in memory.

    :meth:`floor` is the engine's own in-process reload of those tensors, in the refit's bucket
    order: the least any refit into this engine can cost. :meth:`stages` times one colocated
    refit's steps in process (pack, the receiver's copies of split layers, ``load_weights``,
    finalize), to explain a gap to the floor.
    """

    def __init__(self, model_dir: str, bucket_bytes: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from rl_vllm.config import VllmConfig
        from rl_vllm.engine_refit import _own_worker
        from rl_vllm.worker import VllmGenerationWorker
        from rlcore.config.generation import GenerationConfig
        from rlcore.refit import metadata_of, plan_buckets
        from rlcore.refit.buckets import buffer_bytes

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.state = model.state_dict()
        if model.config.tie_word_embeddings:  # a refit sends the tied head once, as the embedding
            self.state.pop("lm_head.weight", None)
        self.meta = metadata_of(self.state.items())
        self.plan = plan_buckets(self.meta, bucket_bytes)
        self.buffer = torch.empty(buffer_bytes(self.plan), dtype=torch.uint8)
        self.engine = VllmGenerationWorker(
            GenerationConfig(model_name=model_dir, max_new_tokens=8),
            VllmConfig(kv_cache_space_gb=KV_CACHE_GB, max_model_len=128),
            engine_rank=0,
        )
        self.vllm_worker = self.engine.llm.collective_rpc(_own_worker)[0]

    def floor(self) -> float:
        from rl_vllm.refit import InPlaceReload

        start = time.perf_counter()
        reload = InPlaceReload(self.vllm_worker)
        for bucket in self.plan:
            reload.load([(name, self.state[name]) for name in bucket.names])
        reload.finish()
        return time.perf_counter() - start

    def stages(self, profile: Any = None) -> dict[str, float]:
        from rl_vllm.refit import InPlaceReload
        from rlcore.refit.buckets import pack, split_layer_names, unpack

        split = split_layer_names(self.plan)
        stage = dict.fromkeys(("pack", "copy_split_layers", "load_weights", "finalize", "whole"), 0.0)
        start = time.perf_counter()
        reload = InPlaceReload(self.vllm_worker)  # initialize_layerwise_reload
        source = iter(self.state.items())
        for bucket in self.plan:
            t0 = time.perf_counter()
            pack(bucket, source, self.buffer, self.meta)
            t1 = time.perf_counter()
            batch = unpack(bucket, self.buffer, self.meta, copy=split)
            t2 = time.perf_counter()
            if profile is not None:
                profile.enable()
            reload.load(batch)
            if profile is not None:
                profile.disable()
            t3 = time.perf_counter()
            stage["pack"] += t1 - t0
            stage["copy_split_layers"] += t2 - t1
            stage["load_weights"] += t3 - t2
        t0 = time.perf_counter()
        reload.finish()  # finalize_layerwise_reload + the every-parameter check
        stage["finalize"] = time.perf_counter() - t0
        stage["whole"] = time.perf_counter() - start
        return stage

    def close(self) -> None:
        self.engine.shutdown()


def breakdown(engine: InProcessEngine, repeats: int) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Median seconds of each stage, and the functions ``load_weights`` spends most time in (last pass)."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    runs = [engine.stages(profile if i == repeats else None) for i in range(repeats + 1)]
    stats = pstats.Stats(profile).stats  # {(file, line, func): (cc, nc, tottime, cumtime, callers)}
    top = sorted(((func, row[2]) for (_, _, func), row in stats.items()), key=lambda x: -x[1])[:5]
    return {k: statistics.median(r[k] for r in runs[1:]) for k in runs[0]}, top  # the first is the warm-up
