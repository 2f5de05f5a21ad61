"""Conformance checks of a training backend declaring ``value_head``: its value models (rlcore 0.3).

A value model is ``Policy(..., model_head="value")``: the language model's trunk with Hugging Face's
token-classification head (one label). The pure pieces (:func:`hf_values`, :func:`value_sgd_step`,
:class:`SquaredErrorValueLoss`) serve a backend's own tests; :class:`ValueModelConformance` is a pytest mixin for
a :class:`~rlcore.testing.conformance.TrainingBackendConformance` subclass (it uses that class's ``backend_spec``
fixture and the tiny Llama)::

    class TestMyBackend(TrainingBackendConformance, ValueModelConformance):
        backend_name = "mybackend"

Against a single-process float64 Hugging Face ``AutoModelForTokenClassification`` loaded from the policy's own
first checkpoint (so the checkpoint format is checked too), on ``world_size`` ranks:

- the checkpoint loads with ``num_labels == 1``, its trunk is the causal LM's and its head is freshly
  initialised (zero bias, weights of about ``initializer_range``);
- ``get_values`` is ``[B, S]`` float32, position 0 and padding 0, equal to the reference shifted as logprobs are
  (plain, and dynamic batching / sequence packing where declared);
- one SGD step of a squared-error loss gives the reference's loss and post-step weights, a few more lower it;
- a value policy resumed from a step's weights and optimizer state (SGD with momentum) takes the next step as
  the uninterrupted run did;
- the token-distribution methods are refused on the driver, naming the cause.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from rlcore.interfaces.loss import LossType
from rlcore.plugins import Capability
from rlcore.testing.conformance.checkers import logprob_problems
from rlcore.testing.oracle import close, weight_problems

if TYPE_CHECKING:
    import torch

    from rlcore.config.batch_plan import BatchingMode

#: The batching modes a value model is checked in, with the capability each needs.
VALUE_MODES: dict[BatchingMode, Capability | None] = {
    "plain": None,
    "dynamic": Capability.DYNAMIC_BATCHING,
    "packing": Capability.SEQUENCE_PACKING,
}
#: The SGD momentum of the kit's value policy: state in the optimizer that a resumed run must restore.
VALUE_MOMENTUM = 0.9
#: The token budget of a logprob (and values) micro-batch in the dynamic and packing modes: several per rank.
VALUE_MB_TOKENS = 48


class SquaredErrorValueLoss:
    """``sum((V(s_i) - returns_i)^2) / global valid tokens`` over the valid tokens (``token_mask * sample_mask`` at
    positions 1..S-1): the value model's first argument is its values, where a language model's is logprobs."""

    loss_type = LossType.TOKEN_LEVEL

    def __call__(
        self, values: torch.Tensor, data: Any, global_valid_seqs: torch.Tensor, global_valid_toks: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        mask = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).to(values)
        error = (values[:, 1:] - data["returns"][:, 1:].to(values)) ** 2
        loss = (error * mask).sum() / global_valid_toks.to(values)
        return loss, {"value_loss": loss.detach()}


def with_returns(batch: Any, seed: int = 5) -> Any:
    """``batch`` with ``returns`` ``[B, S]`` float32 targets (0 outside the valid tokens), seeded."""
    import torch

    from rlcore.data import BatchedDataDict

    gen = torch.Generator().manual_seed(seed)
    returns = torch.randn(batch["input_ids"].shape, generator=gen) * batch["token_mask"]
    return BatchedDataDict({**batch, "returns": returns})


def hf_values(model: Any, data: Any) -> torch.Tensor:
    """``[B, S]`` values of a Hugging Face token-classification model with one label, in its own dtype: position
    ``i`` is the head's output at position ``i - 1``; position 0 and padding are 0 (the logprob alignment)."""
    import torch

    ids, lengths = data["input_ids"], data["input_lengths"]
    valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    head = model(input_ids=ids, attention_mask=valid.long()).logits[..., 0]
    values = torch.zeros_like(head)
    values[:, 1:] = head[:, :-1]
    return torch.where(valid, values, torch.zeros_like(values))


@contextlib.contextmanager
def driver_batching(policy: Any, mode: BatchingMode, mb_tokens: int = VALUE_MB_TOKENS) -> Iterator[None]:
    """``policy`` cuts its data in ``mode`` inside the block, with ``mb_tokens`` per micro-batch (training and
    values). Only the driver reads the batch plan (each worker call is told the mode), so this saves starting a
    policy per mode."""
    import dataclasses

    resolved = policy.resolved
    batch = dataclasses.replace(resolved.batch, mode=mode, logprob_mb_tokens=mb_tokens, train_mb_tokens=mb_tokens)
    policy.resolved = dataclasses.replace(resolved, batch=batch)
    try:
        yield
    finally:
        policy.resolved = resolved


def load_value_checkpoint(path: str | Path) -> Any:
    """A saved value model as Hugging Face loads it: ``AutoModelForTokenClassification`` in float64, eval mode."""
    import torch
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(str(path), dtype=torch.float64).eval()


def value_sgd_step(model: Any, data: Any, loss_fn: Any, lr: float) -> float:
    """One plain SGD step of ``model`` on all of ``data`` (in place); returns the step's loss."""
    import torch

    model.zero_grad(set_to_none=True)
    sample_mask = data["sample_mask"].double()
    toks = (data["token_mask"][:, 1:].double() * sample_mask[:, None]).sum()
    loss, _ = loss_fn(hf_values(model, data), data, sample_mask.sum(), toks)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return float(loss.detach())


def weights_of(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def head_problems(saved: Any, causal_lm_dir: str) -> list[str]:
    """A value model built from a causal LM: one label, the LM's trunk, a fresh head (zero bias, weights of the
    size Hugging Face initialises them with)."""
    from rlcore.testing.oracle import load_hf_model

    problems = []
    if saved.config.num_labels != 1:
        problems.append(f"the saved value model has num_labels={saved.config.num_labels}, expected 1")
    lm = load_hf_model(causal_lm_dir).state_dict()
    state = saved.state_dict()
    trunk = {k for k in state if not k.startswith("score.")}
    if missing := sorted(k for k in trunk if k not in lm):
        problems.append(f"trunk parameters the causal LM does not have: {missing[:3]}")
    elif moved := [k for k in sorted(trunk) if float((state[k] - lm[k].double()).abs().max()) > 0]:
        problems.append(f"the trunk is not the causal LM's: {moved[:3]} differ")
    bias, weight = state.get("score.bias"), state.get("score.weight")
    if bias is None or weight is None:
        return problems + ["the saved value model has no score.weight / score.bias"]
    if bias.abs().max() != 0:
        problems.append(f"a fresh head's bias is 0, got {bias.tolist()}")
    expected = float(saved.config.initializer_range)
    std = float(weight.std())
    if not 0.5 * expected < std < 1.5 * expected:
        problems.append(f"a fresh head's weights have std {std:.3g}, expected about initializer_range={expected}")
    return problems


class ValueModelConformance:
    """The value-model checks (capability ``value_head``), mixed into a ``TrainingBackendConformance`` subclass;
    they skip for a backend that does not declare it. Test names start with ``test_value_``."""

    world_size: ClassVar[int] = 2
    #: SGD learning rate of the value steps.
    value_learning_rate: ClassVar[float] = 0.01
    #: float32 backend vs float64 reference.
    value_atol: ClassVar[float] = 1e-5
    value_loss_rtol: ClassVar[float] = 1e-5
    value_weight_rtol: ClassVar[float] = 1e-5
    #: A resumed run vs the uninterrupted one (same backend and layout).
    value_resume_rtol: ClassVar[float] = 1e-6
    #: More steps of the same batch, after the compared one: the loss must fall.
    value_extra_steps: ClassVar[int] = 3

    def value_policy_overrides(self) -> dict:
        """Extra ``policy`` config of the value model (default: :meth:`policy_overrides` of the kit class)."""
        own = getattr(self, "policy_overrides", None)
        return own() if callable(own) else {}

    @pytest.fixture(scope="class")
    @classmethod
    def value_kit(cls, request: pytest.FixtureRequest, tmp_path_factory: Any) -> Any:
        spec = request.getfixturevalue("backend_spec")
        if not spec.supports(Capability.VALUE_HEAD):
            pytest.skip(f"backend '{spec.name}' does not declare 'value_head'")
        request.getfixturevalue("ray_session")
        kit = _ValueKit(
            cls,
            spec,
            request.getfixturevalue("tiny_model_dir"),
            request.getfixturevalue("tiny_tokenizer"),
            tmp_path_factory.mktemp(f"value-{cls.__name__}"),
        )
        try:
            yield kit
        finally:
            kit.shutdown()

    def test_value_checkpoint_is_token_classification(self, value_kit: _ValueKit) -> None:
        """The first checkpoint loads with ``AutoModelForTokenClassification`` (one label): the causal LM's trunk
        and a freshly initialised head."""
        problems = head_problems(value_kit.reference, value_kit.model_dir)
        assert not problems, "\n".join(problems)

    @pytest.mark.parametrize("mode", list(VALUE_MODES))
    def test_value_values_match_hf(self, value_kit: _ValueKit, mode: BatchingMode) -> None:
        """``get_values``: [B, S] float32, position 0 and padding 0, equal to the float64 reference."""
        capability = VALUE_MODES[mode]
        if capability is not None and not value_kit.spec.supports(capability):
            pytest.skip(f"backend '{value_kit.spec.name}' does not declare '{capability}'")
        values = value_kit.values[mode]
        problems = logprob_problems(
            values,
            value_kit.batch["input_lengths"],
            value_kit.expected_values.float(),
            self.value_atol,
            what=f"values ({mode}) vs the float64 Hugging Face token-classification forward",
        )
        assert not problems, "\n".join(problems)

    def test_value_step_matches_single_process(self, value_kit: _ValueKit) -> None:
        """One SGD step of a squared-error loss: the loss and the saved weights equal the float64 single-process
        step's; a few more steps on the same batch lower the loss."""
        run = value_kit.trained()
        problems = []
        if not close(run["loss"], run["expected_loss"], self.value_loss_rtol):
            problems.append(f"value loss {run['loss']:.8g}, single-process float64 {run['expected_loss']:.8g}")
        problems += weight_problems(
            run["weights"], run["expected_weights"], run["initial"], self.value_weight_rtol, what="value weights"
        )
        losses = run["losses"]
        if not losses[-1] < losses[0]:
            problems.append(f"{len(losses)} steps on one batch did not lower the value loss: {losses}")
        assert not problems, "\n".join(problems)

    def test_value_checkpoint_resumes(self, value_kit: _ValueKit) -> None:
        """A value policy started from a step's weights and optimizer state (SGD with momentum) takes the next
        step exactly as the uninterrupted run did: the loss and every weight."""
        run, resumed = value_kit.trained(), value_kit.resumed()
        problems = []
        if not close(resumed["loss"], run["losses"][1], self.value_resume_rtol):
            problems.append(f"resumed step-2 loss {resumed['loss']:.8g}, uninterrupted {run['losses'][1]:.8g}")
        problems += weight_problems(
            resumed["weights"],
            run["step2_weights"],
            run["weights"],
            self.value_resume_rtol,
            what="weights after the resumed step 2 vs the uninterrupted run (was the optimizer state restored?)",
        )
        assert not problems, "\n".join(problems)

    def test_value_model_has_no_token_distribution(self, value_kit: _ValueKit) -> None:
        """Logprobs, top-k, generation and a loss asking for more than values are refused on the driver, naming
        the cause."""
        from rlcore.training.value_head import NoTokenDistributionError

        policy = value_kit.policy
        assert policy.model_head == "value"
        calls: dict[str, Callable[[], object]] = {
            "get_logprobs": lambda: policy.get_logprobs(value_kit.batch),
            "get_reference_policy_logprobs": lambda: policy.get_reference_policy_logprobs(value_kit.batch),
            "get_topk_logits": lambda: policy.get_topk_logits(value_kit.batch, k=2),
            "generate": lambda: policy.generate(value_kit.batch),
        }

        class EntropyBonus(SquaredErrorValueLoss):
            inputs = ("entropy",)

        calls[f"train with {EntropyBonus.__name__} (it asks for entropy)"] = lambda: policy.train(
            value_kit.batch, EntropyBonus()
        )
        for name, call in calls.items():
            with pytest.raises(NoTokenDistributionError, match=f"^{re.escape(name)}: a value model has no token"):
                call()


class _ValueKit:
    """The class-wide state: one value policy, its values in every mode before training, its training run."""

    def __init__(
        self, cls: type[ValueModelConformance], spec: Any, model_dir: str, tokenizer: Any, tmp_dir: Path
    ) -> None:
        import torch

        from rlcore.config import load_config_dict
        from rlcore.data import BatchedDataDict
        from rlcore.policy import Policy
        from rlcore.testing.conformance.backend_checks import deep_merge
        from rlcore.testing.models import make_batch
        from rlcore.testing.pytest_plugin import ClusterPool

        self.cls, self.spec, self.model_dir, self.tmp_dir = cls, spec, model_dir, tmp_dir
        self.gbs = 4 * cls.world_size
        self.batch = with_returns(BatchedDataDict(make_batch(tokenizer, self.gbs, 5, 16, seed=4321)))
        lr = cls.value_learning_rate
        policy = {
            "backend": spec.name,
            "model_name": model_dir,
            "train_global_batch_size": self.gbs,
            "train_micro_batch_size": 1,
            "logprob_batch_size": 2,
            "learning_rate": lr,
            "max_grad_norm": None,
            "precision": "float32",
            "max_total_sequence_length": 32,
        }
        if getattr(cls, "reads_policy_optimizer", True):  # else value_policy_overrides gives it in the backend's terms
            # momentum: optimizer state a resumed run must restore (the first step is plain SGD's)
            policy["optimizer"] = {"name": "torch.optim.SGD", "kwargs": {"lr": lr, "momentum": VALUE_MOMENTUM}}
        policy = deep_merge(policy, cls().value_policy_overrides())
        config = load_config_dict({"cluster": {"workers_per_node": cls.world_size}, "policy": policy}).policy
        self.clusters = ClusterPool()
        self.config, self.tokenizer = config, tokenizer
        self.policy = Policy(
            self.clusters(cls.world_size), config, tokenizer, name_prefix="kit-value", model_head="value"
        )
        initial_dir = tmp_dir / "initial"
        self.policy.save_checkpoint(str(initial_dir))
        self.reference = load_value_checkpoint(initial_dir)
        with torch.no_grad():
            self.expected_values = hf_values(self.reference, self.batch)
        self.values = {mode: self._values_in(mode) for mode, cap in VALUE_MODES.items() if self._declared(cap)}
        self._trained: dict[str, Any] | None = None
        self._resumed: dict[str, Any] | None = None

    def _declared(self, capability: Capability | None) -> bool:
        return capability is None or self.spec.supports(capability)

    def _values_in(self, mode: BatchingMode) -> torch.Tensor:
        with driver_batching(self.policy, mode):
            values: torch.Tensor = self.policy.get_values(self.batch)["values"]
        return values

    def trained(self) -> dict[str, Any]:
        """One step compared with the float64 oracle, then ``value_extra_steps`` more (each run once)."""
        if self._trained is not None:
            return self._trained
        loss_fn = SquaredErrorValueLoss()
        oracle = load_value_checkpoint(self.tmp_dir / "initial")
        oracle.train()
        initial = weights_of(oracle)
        expected_loss = value_sgd_step(oracle, self.batch, loss_fn, self.cls.value_learning_rate)
        losses = [float(self.policy.train(self.batch, loss_fn)["loss"][0])]
        step_dir = self.tmp_dir / "step1"
        self.policy.save_checkpoint(str(step_dir / "weights"), str(step_dir / "optimizer"))
        weights = weights_of(load_value_checkpoint(step_dir / "weights"))
        losses += [float(self.policy.train(self.batch, loss_fn)["loss"][0])]
        self.policy.save_checkpoint(str(self.tmp_dir / "step2"))
        losses += [float(self.policy.train(self.batch, loss_fn)["loss"][0]) for _ in range(self.cls.value_extra_steps)]
        self._trained = {
            "loss": losses[0],
            "losses": losses,
            "expected_loss": expected_loss,
            "weights": weights,
            "expected_weights": weights_of(oracle),
            "initial": initial,
            "step2_weights": weights_of(load_value_checkpoint(self.tmp_dir / "step2")),
        }
        return self._trained

    def resumed(self) -> dict[str, Any]:
        """A value policy started from the step-1 checkpoint (weights and optimizer, as ``--resume`` starts it)
        takes step 2: its loss and weights (each run once)."""
        if self._resumed is not None:
            return self._resumed
        from rlcore.policy import Policy

        self.trained()
        step_dir = self.tmp_dir / "step1"
        cluster = self.clusters(self.cls.world_size)
        policy = Policy(
            cluster,
            self.config,
            self.tokenizer,
            name_prefix="kit-value-resumed",
            weights_path=str(step_dir / "weights"),
            optimizer_path=str(step_dir / "optimizer"),
            model_head="value",
        )
        try:
            loss = float(policy.train(self.batch, SquaredErrorValueLoss())["loss"][0])
            policy.save_checkpoint(str(self.tmp_dir / "resumed-step2"))
        finally:
            policy.shutdown()
        self._resumed = {"loss": loss, "weights": weights_of(load_value_checkpoint(self.tmp_dir / "resumed-step2"))}
        return self._resumed

    def shutdown(self) -> None:
        self.policy.shutdown()
        self.clusters.shutdown()
