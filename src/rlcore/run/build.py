"""The pieces of a run: cluster, policy, generation backend and weight synchronizer, started and stopped together.

The generation backend is either a separate plugin (e.g. vLLM, colocated with
the policy or on its own resources, refit through
:class:`~rlcore.refit.WeightSynchronizer`) or the training backend itself when
it can generate (e.g. ``fsdp1``). Everything is decided by the resolved config
(:func:`rlcore.config.resolve`); nothing here resolves again.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore.config import ResolvedConfig, resolve
from rlcore.run.output import run_log_dir

if TYPE_CHECKING:
    from rlcore.config import BatchPlan


@dataclass
class Run:
    """Everything a run holds, built from a resolved config (pieces not started yet are None). An algorithm sees
    it as a :class:`rlcore.interfaces.run.RunContext`."""

    resolved: ResolvedConfig
    cluster: Any
    policy: Any = None
    generation: Any = None
    synchronizer: Any = None
    tokenizer: Any = None
    start_step: int = 0
    extra_clusters: list[Any] = field(default_factory=list)
    environment: Any = None  # an rlcore.environments.runner.EnvironmentRunner
    teacher: Any = None  # on-policy distillation's frozen teacher Policy
    value_model: Any = None  # a trained critic Policy with a value head (PPO's), checkpointed beside the policy
    data: Any = None  # the run's samples (rlcore.datasets.sources.RunData)
    num_steps: int = 0  # steps the run trains: grpo.max_num_steps, or fewer when grpo.max_num_epochs ends it
    next_batch: int = 0  # the data position: the next batch of data.train a synchronous step draws
    engines: Any = None  # rlcore.run.engine_recovery.EngineRecovery: restarts an engine that died
    # Rollouts generated ahead before an interruption, from weights older than the checkpoint's, by the step they
    # are for: a resumed asynchronous run trains on these instead of generating them again (docs/reproducibility.md).
    resumed_rollouts: dict[int, Any] = field(default_factory=dict)
    # Set by a loop that generates ahead: the rollouts a checkpoint saved now must carry (rlcore.run.checkpoints).
    carried_rollouts: Any = None

    def draw_train_batch(self) -> list[Any]:
        """The next batch of training samples; moves the data position (raises
        :class:`rlcore.datasets.DataExhausted` past ``grpo.max_num_epochs``)."""
        samples = self.data.train.batch(self.next_batch)
        self.next_batch += 1
        return samples

    @property
    def cfg(self) -> Any:
        """The whole config, every decision written in (``resolved.config``)."""
        return self.resolved.config

    @property
    def batch(self) -> BatchPlan:
        """How the policy cuts a global batch (``resolved.policy.batch``)."""
        return self.resolved.policy.batch

    def shutdown(self) -> None:
        """Stop the synchronizer, the generation backend, the policy and the clusters (each tried even if one
        fails)."""
        parts = [
            self.environment,
            self.synchronizer,
            self.generation if self.generation is not self.policy else None,
            self.teacher,
            self.value_model,
            self.policy,
            *self.extra_clusters,
            self.cluster,
        ]
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


def load_run_data(cfg: Any, tokenizer: Any = None) -> Any:
    """The run's samples (:class:`rlcore.datasets.sources.RunData`), read and checked by the run's algorithm
    (:meth:`rlcore.interfaces.algorithm.Algorithm.load_data`); raises :class:`rlcore.datasets.DataError` (one
    line) before anything starts."""
    from rlcore.config.schemas import load_algorithm
    from rlcore.run.prompts import load_tokenizer

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    return load_algorithm(cfg.algorithm).load_data(cfg, tokenizer)


def build_run(
    config: Any, resume_dir: Path | None = None, start_step: int = 0, tokenizer: Any = None, data: Any = None
) -> Run:
    """Read the data; start the cluster, the environment, the policy, the generation backend and the synchronizer.

    ``config``: a :class:`~rlcore.config.ResolvedConfig`, or an ``RLCoreConfig`` (resolved here with
    ``rlcore run``'s defaults). ``tokenizer`` and ``data`` (:func:`load_run_data`): the run's, when the caller
    has loaded them already. If anything fails to start, what was started is shut down before the error
    propagates.
    """
    from rlcore.config.schemas import load_algorithm
    from rlcore.distributed import RayVirtualCluster
    from rlcore.distributed.reaper import SESSION_ENV
    from rlcore.distributed.startup_signals import signal_self_at
    from rlcore.environments.runner import EnvironmentRunner
    from rlcore.plugins import declared_kwargs
    from rlcore.policy import Policy
    from rlcore.refit import WeightSynchronizer
    from rlcore.run.engine_recovery import with_restarts
    from rlcore.run.prompts import load_tokenizer

    resolved = config if isinstance(config, ResolvedConfig) else resolve(config, run=True)
    cfg, gen = resolved.config, resolved.generation  # gen: None for an SFT run, which does not generate
    colocated = gen is not None and gen.separate and gen.colocated
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    data = data if data is not None else load_run_data(cfg, tokenizer)
    # worker groups sharing each bundle
    groups = 1 + int(colocated) + int(resolved.teacher is not None) + int(resolved.value_model is not None)
    cluster = RayVirtualCluster.from_config(cfg.cluster, max_colocated_worker_groups=groups)
    run = Run(
        resolved,
        cluster,
        tokenizer=tokenizer,
        start_step=start_step,
        data=data,
        num_steps=data.num_steps(cfg.algorithm_section.max_num_steps),
        next_batch=start_step,
    )
    try:
        if resolved.environment is not None:  # an SFT run scores nothing
            run.environment = EnvironmentRunner.from_resolved(
                resolved.environment, cfg.env, log_dir=run_log_dir(cfg.logger.output_dir)
            )
            check_prompts_with_tools(cfg, tokenizer, data, run.environment.tools)
        weights = optimizer = None
        if resume_dir is not None:
            weights, optimizer = str(resume_dir / "weights"), str(resume_dir / "optimizer")
        signal_self_at("workers")  # test hook (RLCORE_TEST_SIGNAL_AT), nothing when unset
        # The reference model only feeds the KL term: without one, no rank keeps its copy of the weights.
        run.policy = Policy(
            cluster,
            resolved.policy,
            tokenizer,
            weights_path=weights,
            optimizer_path=optimizer,
            init_reference_model=load_algorithm(cfg.algorithm).needs_reference_model(cfg),
            model_head=resolved.policy_head,
        )
        if resolved.teacher is not None:  # frozen: no optimizer, no reference copy
            run.teacher = Policy(
                cluster,
                resolved.teacher,
                tokenizer,
                name_prefix="teacher",
                init_optimizer=False,
                init_reference_model=False,
            )
        if resolved.value_model is not None:  # trained beside the policy: its own optimizer and checkpoints
            run.value_model = start_value_model(resolved.value_model, cluster, tokenizer, resume_dir)
        run.generation = run.policy
        if gen is not None and gen.separate:
            gen_cluster = cluster
            if not colocated:
                res = gen.config.colocated.resources
                gen_cluster = RayVirtualCluster(
                    [res.workers_per_node] * res.num_nodes, use_gpus=cfg.cluster.use_gpu, name="rlcore-generation"
                )
                run.extra_clusters.append(gen_cluster)
            available = {"tokenizer": tokenizer, "backend_config": gen.section}
            if gen.adapter_refit:
                available["lora_rank"] = cfg.policy.lora.dim
            if cfg.policy.hf_config_overrides:
                available["hf_config_overrides"] = dict(cfg.policy.hf_config_overrides)
            driver_class = gen.spec.load_driver_class()  # it declares hf_config_overrides if set (resolve checked)
            driver_kwargs = declared_kwargs(driver_class, available)  # only the keyword arguments it declares

            def start_engines(gen_cluster: Any = gen_cluster) -> tuple[Any, Any]:
                generation = driver_class(gen_cluster, gen.config, **driver_kwargs)
                return generation, WeightSynchronizer(
                    run.policy,
                    generation,
                    colocated=colocated,
                    cluster=cluster,
                    partial_refit=gen.partial_refit,
                    adapter_refit=gen.adapter_refit,
                    scratch_dir=os.environ.get(SESSION_ENV),
                    verify=gen.verify_refit,  # policy.generation.verify_refit, decided at resolution
                    weight_version=run.synchronizer.policy_weight_version if run.synchronizer else run.start_step,
                )

            signal_self_at("engines")
            run.generation, run.synchronizer = start_engines()
            with_restarts(run, start_engines, gen_cluster, gen.config.engine_restarts_per_step)
    except BaseException:
        with contextlib.suppress(Exception):  # the start-up error is the one worth reporting
            run.shutdown()
        raise
    return run


def check_prompts_with_tools(cfg: Any, tokenizer: Any, data: Any, tools: list[dict[str, Any]] | None) -> None:
    """The prompts checked before the run, and every row drawn later, measured again with the environment's tools
    in the chat template (known once the environment is built): each must still leave room for a completion
    (:class:`rlcore.datasets.DataError` naming the row). Nothing to do without tools, or with
    ``data.max_input_seq_length``, which cuts long prompts instead."""
    from rlcore.datasets.sources import RunData, length_check
    from rlcore.run.step import prompt_length_of

    if not tools or cfg.data.max_input_seq_length is not None or not isinstance(data, RunData):
        return
    data.add_check(length_check(prompt_length_of(cfg, tokenizer, tools), cfg.policy.max_total_sequence_length))


def start_value_model(resolved: Any, cluster: Any, tokenizer: Any, resume_dir: Path | None) -> Any:
    """The critic: a Policy of ``resolved`` built with ``model_head="value"`` on the run's workers, restored from
    ``<step>/value/`` when resuming (:func:`rlcore.run.checkpoints.save_step` writes it there)."""
    from rlcore.policy import Policy
    from rlcore.run.checkpoints import VALUE_MODEL

    weights = optimizer = None
    if resume_dir is not None:
        weights, optimizer = str(resume_dir / VALUE_MODEL / "weights"), str(resume_dir / VALUE_MODEL / "optimizer")
    return Policy(
        cluster,
        resolved,
        tokenizer,
        name_prefix="value",
        weights_path=weights,
        optimizer_path=optimizer,
        init_reference_model=False,
        model_head="value",
    )
