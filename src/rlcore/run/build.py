"""The pieces of a GRPO run: cluster, policy, generation backend and weight synchronizer, started and stopped together.

The generation backend is either a separate plugin (e.g. vLLM, colocated with
the policy or on its own resources, refit through
:class:`~rlcore.refit.WeightSynchronizer`) or the training backend itself when
it can generate (e.g. ``fsdp1``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Run:
    """Everything a GRPO run holds, built from a validated config (pieces not started yet are None)."""

    cfg: Any
    cluster: Any
    policy: Any = None
    generation: Any = None
    synchronizer: Any = None
    tokenizer: Any = None
    start_step: int = 0
    extra_clusters: list[Any] = field(default_factory=list)

    def shutdown(self) -> None:
        """Stop the synchronizer, the generation backend, the policy and the clusters (each tried even if one
        fails)."""
        parts = [self.synchronizer, self.generation if self.generation is not self.policy else None, self.policy,
                 *self.extra_clusters, self.cluster]
        errors = []
        for part in parts:
            if part is None:
                continue
            try:
                part.shutdown()
            except Exception as exc:  # noqa: BLE001 - the rest must still be stopped
                errors.append(exc)
        if errors:
            raise errors[0]


def build_run(cfg: Any, resume_dir: Path | None = None, start_step: int = 0) -> Run:
    """Start the cluster, the policy, the generation backend and the synchronizer.

    If anything fails to start, what was started is shut down before the error propagates.
    """
    from transformers import AutoTokenizer

    from rlcore.distributed import RayVirtualCluster
    from rlcore.plugins import get_registry
    from rlcore.policy import Policy
    from rlcore.refit import WeightSynchronizer
    from rlcore.run.prompts import configure_tokenizer

    gen_cfg = cfg.policy.generation
    separate = gen_cfg.backend != cfg.policy.training_backend
    colocated = separate and gen_cfg.colocated.enabled
    tokenizer = configure_tokenizer(AutoTokenizer.from_pretrained(cfg.policy.tokenizer.name or cfg.policy.model_name),
                                    cfg.policy.tokenizer)
    cluster = RayVirtualCluster.from_config(cfg.cluster, max_colocated_worker_groups=2 if colocated else 1)
    run = Run(cfg, cluster, tokenizer=tokenizer, start_step=start_step)
    try:
        weights = optimizer = None
        if resume_dir is not None:
            weights, optimizer = str(resume_dir / "weights"), str(resume_dir / "optimizer")
        # The reference model only feeds the KL term: without one, no rank keeps its copy of the weights.
        run.policy = Policy(cluster, cfg.policy, tokenizer, weights_path=weights, optimizer_path=optimizer,
                            init_reference_model=cfg.loss.reference_policy_kl_penalty > 0)
        run.generation = run.policy
        if separate:
            spec = get_registry().resolve(gen_cfg.backend, kind="generation")
            gen_cluster = cluster
            if not colocated:
                res = gen_cfg.colocated.resources
                gen_cluster = RayVirtualCluster([res.workers_per_node] * res.num_nodes,
                                                use_gpus=cfg.cluster.use_gpu, name="rlcore-generation")
                run.extra_clusters.append(gen_cluster)
            lora = cfg.policy.lora
            adapter_refit = lora.enabled and lora.refit == "adapter"  # the rules checked the engine can
            engine_options = {"lora_rank": lora.dim} if adapter_refit else {}
            run.generation = spec.load_driver_class()(gen_cluster, gen_cfg, tokenizer=tokenizer, **engine_options)
            run.synchronizer = WeightSynchronizer(run.policy, run.generation, colocated=colocated, cluster=cluster,
                                                  partial_refit="partial_refit" in spec.capabilities,
                                                  adapter_refit=adapter_refit)
    except BaseException:
        with contextlib.suppress(Exception):  # the start-up error is the one worth reporting
            run.shutdown()
        raise
    return run
