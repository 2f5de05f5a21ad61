"""Conformance tests for a training backend: logprobs, loss/gradient invariance, reference model, checkpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from rlcore.plugins import Capability
from rlcore.testing.conformance.backend_checks import (
    TRAINING_WORKER_METHODS,
    _BackendChecks,
)
from rlcore.testing.conformance.checkers import logprob_problems
from rlcore.testing.conformance.training_kit import _TrainingKit
from rlcore.testing.oracle import close, load_hf_model, step_problems

if TYPE_CHECKING:
    from rlcore.testing.conformance.resume_check import AdamRecipe


class TrainingBackendConformance(_BackendChecks):
    """Conformance tests for a training backend; subclass as ``Test<Something>``.

    Set :attr:`backend_name` (and :attr:`plugin` when the backend is not
    installed); override :meth:`policy_overrides` for backend settings. Needs
    ``pytest_plugins = ["rlcore.testing.pytest_plugin"]`` in the root conftest.py or in the test module.
    """

    expected_kind = "training"
    required_worker_methods = TRAINING_WORKER_METHODS

    #: Ranks of the multi-rank policies (the dp comparison also runs a 1-rank policy).
    world_size: ClassVar[int] = 2
    #: SGD learning rate of the kit steps: large, so the steps visibly move the weights.
    learning_rate: ClassVar[float] = 0.5
    #: Tolerances. The contracts are exact up to float32 round-off; loosening these
    #: weakens what passing the kit means.
    logprob_atol: ClassVar[float] = 1e-5
    loss_rtol: ClassVar[float] = 1e-5
    grad_norm_rtol: ClassVar[float] = 1e-5
    weight_rtol: ClassVar[float] = 1e-5
    #: Resumed vs uninterrupted training (same backend and layout): weights (absolute), loss and grad norm.
    resume_atol: ClassVar[float] = 1e-6
    resume_rtol: ClassVar[float] = 1e-6
    #: The uninterrupted Adam run vs the single-process Adam oracle, relative to the largest update.
    #: Looser than ``weight_rtol``: Adam divides by sqrt(v), so gradient round-off shows up larger.
    resume_oracle_rtol: ClassVar[float] = 1e-3
    topk_k: ClassVar[int] = 4
    #: Whether the backend builds its optimizer from ``policy.optimizer`` (where the kit puts its plain
    #: SGD). A backend with its own optimizer section (megatron) sets False and gives plain SGD there
    #: through :meth:`policy_overrides`.
    reads_policy_optimizer: ClassVar[bool] = True

    def policy_overrides(self) -> dict:
        """Extra ``policy`` config for every policy of the kit, e.g. ``{"dtensor_cfg": {...}}``."""
        return {}

    def single_rank_policy_overrides(self) -> dict:
        """Extra ``policy`` config for the 1-rank policy; override when ``policy_overrides`` sets tp/pp > 1."""
        return self.policy_overrides()

    def resume_policy_overrides(self, recipe: AdamRecipe) -> dict:
        """``policy`` config for the checkpoint-resume check: the recipe's Adam and LR warm-up.

        The default sets rlcore's generic ``policy.optimizer``/``policy.scheduler``;
        a backend that takes its optimizer from its own section maps the recipe there.
        """
        return recipe.policy_overrides()

    # -- fixtures --------------------------------------------------------------------------
    @pytest.fixture(scope="class")
    @classmethod
    def kit(cls, request: pytest.FixtureRequest, backend_spec: Any, tmp_path_factory: Any) -> Any:
        try:
            request.getfixturevalue("ray_session")
        except pytest.FixtureLookupError:
            pytest.fail(
                "the conformance kit needs its fixtures: add "
                "pytest_plugins = ['rlcore.testing.pytest_plugin'] to your root conftest.py or test module",
                pytrace=False,
            )
        from rlcore.interfaces.workers import worker_problems

        # The worker contract first: a worker that cannot take rlcore's calls fails here, not inside Ray.
        if problems := worker_problems(backend_spec.load_worker_class(), backend_spec):
            pytest.fail(
                f"worker_class {backend_spec.worker_class} breaks the worker contract:\n" + "\n".join(problems),
                pytrace=False,
            )
        model_dir = request.getfixturevalue("tiny_model_dir")
        tokenizer = request.getfixturevalue("tiny_tokenizer")
        kit = _TrainingKit(cls, backend_spec, model_dir, tokenizer, tmp_path_factory.mktemp(f"kit-{cls.__name__}"))
        try:
            yield kit
        finally:
            kit.shutdown()

    # -- logprobs ----------------------------------------------------------------------------
    @pytest.mark.parametrize("variant", ["world", "single", "dynamic", "packing", "chunked"])
    def test_logprobs_match_hf(self, kit: _TrainingKit, variant: str) -> None:
        """[B, S] float32, position 0 and padding 0, equal to a single-process HF forward (design.md §2.2)."""
        record = kit.policy(variant)
        lengths = kit.batch["input_lengths"]
        problems = logprob_problems(record["logprobs"], lengths, kit.initial_logprobs, self.logprob_atol)
        problems += logprob_problems(
            record["noisy_logprobs"],
            lengths,
            kit.initial_logprobs,
            self.logprob_atol,
            what="logprobs (random tokens in the padding)",
        )
        assert not problems, "\n".join(problems)

    def test_topk_logits(self, kit: _TrainingKit) -> None:
        """Next-token rows only ([B, S-1, k]); values are the HF top-k logits at global token ids."""
        import torch

        if not kit.spec.supports(Capability.TOPK_LOGITS):
            pytest.skip(f"backend '{kit.spec.name}' does not declare 'topk_logits'")
        topk = kit.policy("world")["topk"]
        values, indices = topk["topk_logits"], topk["topk_indices"]
        batch, seq = kit.batch["input_ids"].shape
        shape = (batch, seq - 1, self.topk_k)
        assert tuple(values.shape) == shape and tuple(indices.shape) == shape, (
            f"topk shapes {tuple(values.shape)} / {tuple(indices.shape)}, expected {shape}"
        )
        assert indices.dtype == torch.int64, f"topk_indices dtype {indices.dtype}, expected torch.int64"
        rows = torch.arange(seq - 1)[None, :] < (kit.batch["input_lengths"][:, None] - 1)
        logits = kit.initial_logits[:, :-1]
        expected_values = logits.topk(self.topk_k, dim=-1).values
        at_indices = logits.gather(-1, indices.clamp(0, logits.shape[-1] - 1))
        err_values = float(((values - expected_values).abs().amax(-1) * rows).max())
        err_indices = float(((values - at_indices).abs().amax(-1) * rows).max())
        assert err_values <= self.logprob_atol, f"top-k values differ from HF by {err_values:.3g}"
        assert err_indices <= self.logprob_atol, (
            f"top-k values do not match the logits at their indices "
            f"({err_indices:.3g}); indices must be global token ids"
        )

    # -- sharding ---------------------------------------------------------------------------
    def test_data_is_sharded_by_the_declared_layout(self, kit: _TrainingKit) -> None:
        """``Policy`` lays its ranks out by the layout the backend declared (the spec's layout function; pure
        data parallel without one) and splits every batch over the data-parallel ranks that leaves, the ranks
        of the other axes getting the same shard (design.md §2.5). The logprob and training tests hold only
        if every rank got the data its backend's own layout expects."""
        from rlcore.distributed import NamedSharding
        from rlcore.plugins import LayoutRequest, ParallelLayout

        policy = kit.policy("world")["policy"]
        function = kit.spec.load_layout()
        request = LayoutRequest(policy.cfg, policy.resolved.section, self.world_size, policy.resolved.use_gpu)
        declared = function(request) if function else ParallelLayout()
        assert isinstance(declared, ParallelLayout), f"layout {kit.spec.layout} returned {declared!r}"
        expected = NamedSharding.for_world(self.world_size, **declared.sizes())
        assert policy.sharding == policy.worker_group.sharding == expected, (
            f"Policy shards as {policy.sharding}, the backend declares {declared.sizes()} ({expected})"
        )
        assert policy.resolved.batch.data_parallel_size == expected.dp

    # -- training invariance ----------------------------------------------------------------
    def test_loss_invariant_to_micro_batch_size(self, kit: _TrainingKit) -> None:
        """Evaluation loss of one global batch is the same for every micro-batch size (design.md §2.3)."""
        from rlcore.algorithms.sft.loss import NLLLoss

        policy = kit.policy("world")["policy"]
        per_rank = kit.gbs // policy.sharding.dp
        losses = {
            mbs: float(policy.train(kit.batch, NLLLoss(), eval_mode=True, mbs=mbs)["loss"][0])
            for mbs in sorted({1, 2, per_rank})
        }
        first = next(iter(losses.values()))
        assert all(close(v, first, self.loss_rtol) for v in losses.values()), f"eval loss by micro-batch size: {losses}"

    @pytest.mark.parametrize("variant", ["world", "single", "dynamic", "packing", "chunked"])
    def test_train_steps_match_single_process(self, kit: _TrainingKit, variant: str) -> None:
        """An NLL (SFT) step, a clipped-PG (GRPO) step and a DPO step on pairs kept together: losses, grad norms
        and weights equal the oracle's.

        The oracle is plain SGD on the whole batch in this process. Variants
        other than ``single`` are also compared with the 1-rank policy. Weights
        are read back from the checkpoint saved after each step.
        """
        initial, expected = kit.oracle()
        runs = {"single-process oracle": expected}
        if variant != "single":
            runs["1-rank policy"] = kit.trained("single")["steps"]
        actual = kit.trained(variant)["steps"]
        problems = []
        for against, reference in runs.items():
            problems += step_problems(
                actual,
                reference,
                initial,
                f"'{variant}' vs {against}",
                loss_rtol=self.loss_rtol,
                grad_norm_rtol=self.grad_norm_rtol,
                weight_rtol=self.weight_rtol,
            )
        assert not problems, "\n".join(problems)

    # -- reference model ----------------------------------------------------------------------
    def test_reference_logprobs_after_training(self, kit: _TrainingKit) -> None:
        """After training, reference logprobs are the initial ones and the swap leaves the trained weights."""
        import torch

        record = kit.policy("world")
        kit.trained("world")
        policy = record["policy"]
        before = policy.get_logprobs(kit.batch)["logprobs"]
        moved = float((before - record["logprobs"]).abs().max())
        assert moved > 1e-3, f"training moved logprobs by only {moved:.3g}; the swap test would be vacuous"
        ref = policy.get_reference_policy_logprobs(kit.batch)
        assert "reference_logprobs" in ref, f"get_reference_policy_logprobs returned keys {sorted(ref)}"
        problems = logprob_problems(
            ref["reference_logprobs"],
            kit.batch["input_lengths"],
            record["logprobs"],
            self.logprob_atol,
            what="reference_logprobs vs initial logprobs",
        )
        after = policy.get_logprobs(kit.batch)["logprobs"]
        if not torch.allclose(after, before, rtol=0, atol=self.logprob_atol):
            problems.append(
                f"get_logprobs changed by {float((after - before).abs().max()):.3g} after "
                "get_reference_policy_logprobs: the trained weights were not swapped back"
            )
        assert not problems, "\n".join(problems)

    # -- checkpoints --------------------------------------------------------------------------
    def test_checkpoint_round_trip(self, kit: _TrainingKit) -> None:
        """A checkpoint reloads *and resumes*: training continued from it equals uninterrupted training.

        Adam + LR warm-up for three steps, checkpoint (weights + optimizer) after
        the first; a new ``Policy(weights_path=..., optimizer_path=...)`` trains
        steps 2 and 3. The saved weights load with ``AutoModelForCausalLM``, the
        restored policy's logprobs are the saved ones, and the resumed steps'
        losses, grad norms and weights equal the uninterrupted run's, which
        itself matches a single-process Adam oracle. See
        :mod:`rlcore.testing.conformance.resume_check` for how a failure is diagnosed.
        """
        from rlcore.testing.conformance.resume_check import (
            RECIPE,
            ResumeTolerances,
            resume_problems,
        )

        tolerances = ResumeTolerances(self.logprob_atol, self.resume_atol, self.resume_rtol, self.resume_oracle_rtol)
        problems = resume_problems(kit.resumed(), kit.resume_steps, kit.batch, kit.model_dir, RECIPE, tolerances)
        assert not problems, "\n".join(problems)

    # -- refit --------------------------------------------------------------------------------
    def test_prepare_refit_info(self, kit: _TrainingKit) -> None:
        """``{hf_name: (shape, dtype)}`` covering the HF state dict (design.md §2.7)."""
        if not kit.spec.supports(Capability.REFIT):
            pytest.skip(f"backend '{kit.spec.name}' does not declare 'refit'")
        policy = kit.policy("world")["policy"]
        info = policy.prepare_refit_info()
        model = load_hf_model(kit.model_dir)
        state = model.state_dict()
        # Tied parameters (one tensor under two names) may be sent once.
        ptrs: dict[int, list[str]] = {}
        for name, tensor in state.items():
            ptrs.setdefault(tensor.data_ptr(), []).append(name)
        optional = {n for names in ptrs.values() if len(names) > 1 for n in names}
        problems = []
        missing = sorted(set(state) - set(info) - optional)
        if missing:
            problems.append(f"refit info lacks {missing}")
        if extra := sorted(set(info) - set(state)):
            problems.append(f"refit info has names the HF model does not: {extra}")
        for name in sorted(set(info) & set(state)):
            shape, dtype = info[name]
            if tuple(shape) != tuple(state[name].shape):
                problems.append(f"{name}: shape {tuple(shape)}, HF has {tuple(state[name].shape)}")
            if str(dtype).removeprefix("torch.") != "float32":
                problems.append(f"{name}: dtype {dtype}, expected float32 (policy.precision)")
        assert not problems, "\n".join(problems)

    # -- LoRA -----------------------------------------------------------------------------------
    def test_lora_step_matches_peft(self, kit: _TrainingKit) -> None:
        """LoRA ('lora' declared): adapters start as a no-op, one SGD step equals PEFT's single-process step
        (adapters and logprobs), the base weights do not move, the reference policy is the base model, and
        the checkpoint loads with ``peft.PeftModel.from_pretrained`` (``merged/`` with ``AutoModelForCausalLM``)."""
        import torch

        from rlcore.testing.conformance.lora import LORA_SETTINGS, base_weight_problems, peft_adapters, peft_model
        from rlcore.testing.oracle import hf_token_logprobs, weight_problems

        record = kit.policy("lora")
        run = kit.lora_trained()
        expected, lengths = run["expected"], kit.batch["input_lengths"]
        problems = logprob_problems(
            record["logprobs"],
            lengths,
            kit.initial_logprobs,
            self.logprob_atol,
            what="logprobs with fresh adapters (B = 0) vs the base model",
        )
        if not close(run["loss"], expected.loss, self.loss_rtol):
            problems.append(f"loss {run['loss']:.6g}, PEFT oracle {expected.loss:.6g}")
        saved = peft_model(kit.model_dir, run["step_dir"])
        problems += weight_problems(
            peft_adapters(saved),
            expected.adapters,
            expected.initial_adapters,
            self.weight_rtol,
            what="adapters after one step vs PEFT",
        )
        problems += logprob_problems(
            run["logprobs"], lengths, expected.logprobs, self.logprob_atol, what="logprobs after the step vs PEFT"
        )
        with torch.no_grad():
            reloaded = hf_token_logprobs(saved.eval(), kit.batch)
        problems += logprob_problems(
            reloaded, lengths, expected.logprobs, self.logprob_atol, what="the saved adapter loaded with PEFT"
        )
        problems += logprob_problems(
            run["reference"],
            lengths,
            kit.initial_logprobs,
            self.logprob_atol,
            what="reference logprobs (adapters off) vs the base model",
        )
        merged = load_hf_model(str(run["step_dir"] / "merged"))
        with torch.no_grad():
            problems += logprob_problems(
                hf_token_logprobs(merged, kit.batch),
                lengths,
                expected.logprobs,
                self.logprob_atol,
                what="merged/ loaded with AutoModelForCausalLM",
            )
        problems += base_weight_problems(
            run["step_dir"] / "merged", run["step_dir"], kit.model_dir, LORA_SETTINGS["alpha"] / LORA_SETTINGS["dim"]
        )
        assert not problems, "\n".join(problems)

    def test_lora_checkpoint_resumes(self, kit: _TrainingKit) -> None:
        """LoRA ('lora' declared): a policy started from an adapter checkpoint and its optimizer state
        (Adam, LR warm-up) trains on exactly like the uninterrupted one: losses, grad norms, logprobs."""
        from rlcore.testing.conformance.lora import lora_resume_problems

        problems = lora_resume_problems(
            kit.lora_resumed(), kit.batch["input_lengths"], self.logprob_atol, self.resume_atol, self.resume_rtol
        )
        assert not problems, "\n".join(problems)
