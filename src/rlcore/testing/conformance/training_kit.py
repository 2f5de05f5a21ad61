"""The class-wide state of :class:`~rlcore.testing.conformance.training.TrainingBackendConformance`.

One set of policies per test class, each started and trained at most once
(results and failures memoised), the shared batches, and the single-process
oracle they are compared with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rlcore.interfaces.loss import LossType
from rlcore.plugins import Capability
from rlcore.testing.conformance.backend_checks import deep_merge
from rlcore.testing.conformance.lora import LORA_SETTINGS
from rlcore.testing.oracle import (
    StepRecord,
    hf_token_logprobs,
    load_hf_model,
    single_process_sgd,
    train_and_save_step,
    train_one_step_and_save,
)


def dpo_step(raw: dict, reference_logprobs: Any, masked_pair: int | None = 1) -> tuple[Any, Any]:
    """The kit's DPO step: ``(batch, loss)`` with rows 2i / 2i+1 of ``raw`` as pairs (uneven lengths), an SFT term,
    and pair ``masked_pair`` masked out. The core keeps each pair in one micro-batch on one rank
    (``group_size``); a backend that reorders or splits the rows it is given trains on the wrong pairs and fails
    against the oracle, or the loss refuses."""
    import torch

    from rlcore.algorithms.dpo.config import DPOLossConfig
    from rlcore.algorithms.dpo.loss import DPOLossFn
    from rlcore.data import BatchedDataDict

    sample_mask = torch.ones(len(raw["input_lengths"]))
    if masked_pair is not None:
        sample_mask[2 * masked_pair : 2 * masked_pair + 2] = 0.0
    batch = BatchedDataDict(
        {**raw, "sample_mask": sample_mask, "reference_policy_logprobs": reference_logprobs.clone()}
    )
    batch.group_size = 2
    loss = DPOLossFn(
        DPOLossConfig(reference_policy_kl_penalty=0.5, sft_loss_weight=0.2, preference_average_log_probs=True)
    )
    return batch, loss


class SummedLosses:
    """Token-level losses added up, ``weights[i] * losses[i]``, asking for every input any of them asks for (one
    kit step then checks several loss inputs at once)."""

    loss_type = LossType.TOKEN_LEVEL

    def __init__(self, losses: list[Any], weights: list[float]) -> None:
        self.losses, self.weights = losses, weights
        self.inputs = tuple(dict.fromkeys(name for loss in losses for name in getattr(loss, "inputs", ())))

    def __call__(self, logprobs: Any, data: Any, global_valid_seqs: Any, global_valid_toks: Any) -> tuple[Any, dict]:
        total, metrics = 0.0, {}
        for i, (loss_fn, weight) in enumerate(zip(self.losses, self.weights)):
            loss, m = loss_fn(logprobs, data, global_valid_seqs, global_valid_toks)
            total = total + weight * loss
            metrics.update({f"{name}_{i}": value for name, value in m.items()})
        metrics["loss"] = float(total.detach())
        return total, metrics


def distillation_step(
    raw: dict, tokenizer: Any, k: int = 4, seed: int = 7, full_vocabulary: bool = False
) -> tuple[Any, Any]:
    """The kit's distillation step (backends with ``logits_at_indices``): a mixed KL against a made-up teacher's
    top-k (random distinct ids, random logits, aligned like logprobs). A backend that computes the student's
    logits at the wrong position, or at the wrong ids on some tensor-parallel rank, fails against the oracle.
    With ``full_vocabulary`` (backends with ``logprobs_at_indices`` and ``entropy``) a small share of the
    ``zero_outside_topk`` KL is added, whose inputs the oracle recomputes in float64 over the whole vocabulary:
    a backend whose logsumexp or entropy misses part of a split vocabulary fails too."""
    import torch

    from rlcore.algorithms.distillation import TEACHER_LOGITS_KEY, DistillationLossFn
    from rlcore.data import BatchedDataDict
    from rlcore.interfaces.loss import LOGIT_INDICES_KEY

    gen = torch.Generator().manual_seed(seed)
    ids = raw["input_ids"]
    # ids drawn per position from a small pool, so the step moves a few output rows visibly (random ids over the
    # whole vocabulary would give an update too small to compare after the large DPO step)
    pool = torch.randperm(len(tokenizer), generator=gen)[: 2 * k]
    indices = pool[torch.rand(*ids.shape, len(pool), generator=gen).topk(k, dim=-1).indices]
    indices[:, 0] = 0
    logits = 5.0 * torch.randn(*ids.shape, k, generator=gen)
    logits[:, 0] = 0.0
    batch = BatchedDataDict({**raw, LOGIT_INDICES_KEY: indices, TEACHER_LOGITS_KEY: logits})
    within_topk = DistillationLossFn({"kl_type": "mixed", "mixed_kl_weight": 0.3})
    if not full_vocabulary:
        return batch, within_topk
    # the term outside the top-k is ~100 x the student's mass there: a small weight keeps the step comparable
    whole = DistillationLossFn({"kl_type": "mixed", "mixed_kl_weight": 0.5, "zero_outside_topk": True})
    return batch, SummedLosses([within_topk, whole], [1.0, 0.02])


class _Once:
    """Memoises results *and* failures: a policy that failed mid-training must not be trained again."""

    def __init__(self) -> None:
        self._done: dict[str, Any] = {}

    def __call__(self, key: str, fn: Callable[[], Any]) -> Any:
        if key not in self._done:
            try:
                self._done[key] = ("ok", fn())
            except Exception as exc:  # noqa: BLE001 - re-raised now, remembered for later tests
                self._done[key] = ("error", exc)
                raise
        status, value = self._done[key]
        if status == "error":
            pytest.fail(f"{key} failed earlier in this class: {type(value).__name__}: {value}", pytrace=False)
        return value


@dataclass
class _Variant:
    """One way of running the same optimizer steps."""

    name: str
    single_rank: bool = False
    capability: Capability | None = None
    policy: dict = field(default_factory=dict)


class _TrainingKit:
    """The class-wide state: data, the oracle, and lazily built, lazily trained policies."""

    def __init__(self, cls: type, spec: Any, model_dir: str, tokenizer: Any, tmp_dir: Path) -> None:
        import torch

        from rlcore.algorithms.grpo.loss import ClippedPGLossFn
        from rlcore.algorithms.sft.loss import NLLLoss
        from rlcore.data import BatchedDataDict
        from rlcore.testing.conformance.resume_check import resume_steps
        from rlcore.testing.models import make_batch
        from rlcore.testing.pytest_plugin import ClusterPool

        self.author = cls()  # the subclass instance whose hooks we call
        self.cls = cls
        self.spec, self.model_dir, self.tokenizer, self.tmp_dir = spec, model_dir, tokenizer, tmp_dir
        self.clusters = ClusterPool()
        self.policies: dict[str, Any] = {}
        self._clusters_of: dict[str, Any] = {}  # policy name -> its cluster, released with it
        self.once = _Once()
        self.gbs = 4 * cls.world_size

        raw = make_batch(tokenizer, self.gbs, 5, 16, seed=1234)
        self.batch = BatchedDataDict(raw)
        # The same sequences with random tokens in the padding: a backend must
        # use input_lengths, not the pad id, to find where sequences end.
        gen = torch.Generator().manual_seed(99)
        noise = torch.randint(3, 259, raw["input_ids"].shape, generator=gen)
        pad = torch.arange(raw["input_ids"].shape[1])[None, :] >= raw["input_lengths"][:, None]
        self.noisy_batch = BatchedDataDict(
            input_ids=torch.where(pad, noise, raw["input_ids"]), input_lengths=raw["input_lengths"].clone()
        )

        import transformers

        transformers.utils.logging.disable_progress_bar()
        with torch.no_grad():
            model = load_hf_model(model_dir)
            lengths = raw["input_lengths"]
            valid = torch.arange(raw["input_ids"].shape[1])[None, :] < lengths[:, None]
            self.initial_logits = model(input_ids=raw["input_ids"], attention_mask=valid.long()).logits.float()
            self.initial_logprobs = hf_token_logprobs(model, raw)
        del model

        # Step 2: clipped PG + k3 KL, per-sequence normalisation, one sample masked out.
        adv = torch.randn(self.gbs, 1, generator=gen).expand_as(raw["token_mask"]).contiguous()
        sample_mask = torch.ones(self.gbs)
        sample_mask[1] = 0.0
        self.pg_batch = BatchedDataDict(
            {
                **raw,
                "sample_mask": sample_mask,
                "advantages": adv,
                "prev_logprobs": self.initial_logprobs.clone(),
                "reference_policy_logprobs": self.initial_logprobs.clone(),
            }
        )
        pg_loss = ClippedPGLossFn({"reference_policy_kl_penalty": 0.1, "token_level_loss": False})
        self.steps = [(self.batch, NLLLoss()), (self.pg_batch, pg_loss), dpo_step(raw, self.initial_logprobs)]
        if spec.supports(Capability.LOGITS_AT_INDICES):
            whole = spec.supports(Capability.LOGPROBS_AT_INDICES) and spec.supports(Capability.ENTROPY)
            self.steps.append(distillation_step(raw, tokenizer, full_vocabulary=whole))
        self.resume_steps = resume_steps(self.batch, tokenizer, self.gbs)

    # -- oracle --------------------------------------------------------------------------
    def oracle(self) -> tuple[dict, list[StepRecord]]:
        return self.once(
            "the single-process oracle", lambda: single_process_sgd(self.model_dir, self.steps, self.cls.learning_rate)
        )

    # -- policies ------------------------------------------------------------------------
    def variants(self) -> dict[str, _Variant]:
        from rlcore.testing.conformance.resume_check import RECIPE

        gbs = self.gbs
        return {
            v.name: v
            for v in (
                _Variant("world"),
                _Variant("adam", policy=self.author.resume_policy_overrides(RECIPE)),
                # dp=1 and another micro-batch size (2 micro-batches per step instead of 4 per rank)
                _Variant("single", single_rank=True, policy={"train_micro_batch_size": gbs // 2}),
                _Variant(
                    "dynamic",
                    capability=Capability.DYNAMIC_BATCHING,
                    policy={
                        "dynamic_batching": {
                            "enabled": True,
                            "train_mb_tokens": 32,
                            "logprob_mb_tokens": 48,
                            "sequence_length_round": 4,
                        }
                    },
                ),
                _Variant(
                    "packing",
                    capability=Capability.SEQUENCE_PACKING,
                    policy={"sequence_packing": {"enabled": True, "train_mb_tokens": 32, "logprob_mb_tokens": 48}},
                ),
                # 3 positions at a time: several chunks per sequence, a short last one
                _Variant("chunked", capability=Capability.CHUNKED_LOGPROBS, policy={"logprob_chunk_size": 3}),
                _Variant("lora", capability=Capability.LORA, policy={"lora": LORA_SETTINGS}),
                _Variant(
                    "lora-adam",
                    capability=Capability.LORA,
                    policy={**self.author.resume_policy_overrides(RECIPE), "lora": LORA_SETTINGS},
                ),
            )
        }

    def variant(self, name: str) -> _Variant:
        variant = self.variants()[name]
        if variant.capability and not self.spec.supports(variant.capability):
            pytest.skip(f"backend '{self.spec.name}' does not declare '{variant.capability}'")
        return variant

    def config(self, variant: _Variant) -> Any:
        from rlcore.config import load_config_dict

        lr = self.cls.learning_rate
        policy = {
            "backend": self.spec.name,
            "model_name": self.model_dir,
            "train_global_batch_size": self.gbs,
            "train_micro_batch_size": 1,
            "logprob_batch_size": 2,
            "learning_rate": lr,
            "max_grad_norm": None,
            "precision": "float32",
            "max_total_sequence_length": 32,
        }
        if self.cls.reads_policy_optimizer:
            policy["optimizer"] = {"name": "torch.optim.SGD", "kwargs": {"lr": lr}}
        overrides = (
            self.author.single_rank_policy_overrides() if variant.single_rank else self.author.policy_overrides()
        )
        policy = deep_merge(deep_merge(policy, overrides), variant.policy)
        ranks = 1 if variant.single_rank else self.cls.world_size
        return load_config_dict({"cluster": {"workers_per_node": ranks}, "policy": policy}).policy

    def start(self, name: str, variant: _Variant, **kwargs: Any) -> Any:
        """Start a policy for ``variant``, kept as ``self.policies[name]`` until :meth:`stop`."""
        from rlcore.policy import Policy

        cluster = self.clusters(1 if variant.single_rank else self.cls.world_size)
        self._clusters_of[name] = cluster
        policy = Policy(cluster, self.config(variant), self.tokenizer, name_prefix=f"kit-{name}", **kwargs)
        self.policies[name] = policy
        return policy

    def policy(self, name: str) -> dict:
        """Start the variant's policy and record what it computes before any training."""
        variant = self.variant(name)

        def build() -> dict:
            policy = self.start(name, variant)
            record = {
                "policy": policy,
                "logprobs": policy.get_logprobs(self.batch)["logprobs"],
                "noisy_logprobs": policy.get_logprobs(self.noisy_batch)["logprobs"],
            }
            if self.spec.supports(Capability.TOPK_LOGITS):
                record["topk"] = policy.get_topk_logits(self.batch, k=self.cls.topk_k)
            return record

        return self.once(f"starting the '{name}' policy", build)

    def trained(self, name: str) -> dict:
        """The variant's policy after the kit steps (NLL, clipped PG, DPO): losses, grad norms, saved weights per
        step."""
        record = self.policy(name)

        def train() -> dict:
            steps = [
                train_and_save_step(record["policy"], data, loss_fn, self.tmp_dir / f"{name}-step{k}")
                for k, (data, loss_fn) in enumerate(self.steps, start=1)
            ]
            if name != "world":  # the world policy stays up for the swap test
                self.stop(name)
            return {"steps": steps}

        return self.once(f"training the '{name}' policy", train)

    def lora_trained(self) -> dict:
        """The LoRA policy's adapters saved before and after one NLL step, and the PEFT oracle's step."""
        from rlcore.algorithms.sft.loss import NLLLoss
        from rlcore.testing.conformance.lora import peft_sgd_step

        record = self.policy("lora")

        def train() -> dict:
            policy, initial_dir = record["policy"], self.tmp_dir / "lora-initial"
            policy.save_checkpoint(str(initial_dir))
            expected = peft_sgd_step(self.model_dir, initial_dir, self.batch, NLLLoss(), self.cls.learning_rate)
            step_dir = self.tmp_dir / "lora-step1"
            result = train_one_step_and_save(policy, self.batch, NLLLoss(), step_dir)
            return {
                "initial_dir": initial_dir,
                "step_dir": step_dir,
                "loss": float(result["loss"][0]),
                "expected": expected,
                "logprobs": policy.get_logprobs(self.batch)["logprobs"],
                "reference": policy.get_reference_policy_logprobs(self.batch)["reference_logprobs"],
            }

        return self.once("training the 'lora' policy", train)

    def resumed(self) -> Any:
        """The resume check's two policies, run once: uninterrupted Adam, and resumed from its checkpoint."""
        from rlcore.testing.conformance.resume_check import run_resume

        variant = self.variant("adam")
        return self.once(
            "the checkpoint resume run",
            lambda: run_resume(
                lambda name, **kwargs: self.start(name, variant, **kwargs),
                self.stop,
                self.resume_steps,
                self.batch,
                self.tmp_dir,
            ),
        )

    def lora_resumed(self) -> Any:
        """The LoRA resume check's two policies (Adam), run once: uninterrupted, and resumed."""
        from rlcore.testing.conformance.lora import run_lora_resume

        variant = self.variant("lora-adam")
        return self.once(
            "the LoRA resume run",
            lambda: run_lora_resume(
                lambda name, **kwargs: self.start(name, variant, **kwargs),
                self.stop,
                self.resume_steps,
                self.batch,
                self.tmp_dir,
            ),
        )

    def stop(self, name: str) -> None:
        """Shut the policy down and give its bundles back (the kit's policies would not all fit at once)."""
        policy = self.policies.pop(name, None)
        if policy is not None:
            policy.shutdown()
        cluster = self._clusters_of.pop(name, None)
        if cluster is not None:
            cluster.shutdown()

    def shutdown(self) -> None:
        for name in list(self.policies):
            self.stop(name)
        self.clusters.shutdown()
