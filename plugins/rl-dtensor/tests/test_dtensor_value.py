"""dtensor value models (``model_head="value"``) under tensor and sequence parallel, on real Ray workers (gloo).

The conformance kit's value checks run at dp=2 (``test_dtensor_conformance``, ``-k value``); here the same
contract at tp=2 with sequence parallel, where the head sees a sequence-sharded final norm: values (padded and
packed) and one SGD step against a float64 Hugging Face ``AutoModelForTokenClassification`` of the policy's own
first checkpoint, a checkpoint after the step that Hugging Face loads with the policy's values, a run resumed from it
on another layout (dp=2), and refit refused in the worker.
"""

from __future__ import annotations

import pytest
import torch
from dtensor_testlib import LR, call_all, model_dir, policy_config
from dtensor_testlib import batch as make_data

from rlcore.testing.conformance.checkers import logprob_problems
from rlcore.testing.conformance.value_model import (
    SquaredErrorValueLoss,
    driver_batching,
    head_problems,
    hf_values,
    load_value_checkpoint,
    value_sgd_step,
    weights_of,
    with_returns,
)
from rlcore.testing.oracle import close, weight_problems

TOL = 1e-5


@pytest.fixture(scope="module")
def llama() -> str:
    return model_dir("llama")


@pytest.fixture(scope="module")
def data(tiny_tokenizer):
    return with_returns(make_data(tiny_tokenizer))


@pytest.fixture(scope="module")
def started(ray_session, llama, tiny_tokenizer, tmp_path_factory):
    """``get(name)``: a value policy at tp=2 + sequence parallel (``tp2``), or dp=2 resumed from ``weights_path``."""
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy

    policies: dict = {}

    def get(name: str, **kwargs):
        if name not in policies:
            cluster = RayVirtualCluster([2])
            layout = dict(tp=2, sp=True) if name == "tp2" else dict(tp=1)
            config = policy_config(llama, **layout)
            policy = Policy(cluster, config, tiny_tokenizer, name_prefix=f"value-{name}", model_head="value", **kwargs)
            policies[name] = (policy, cluster)
        return policies[name][0]

    yield get
    for policy, cluster in policies.values():
        policy.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def tp2(started, tmp_path_factory):
    """The tp2 value policy and the float64 reference of its initial weights (read back from its checkpoint)."""
    policy = started("tp2")
    initial = tmp_path_factory.mktemp("value-tp2") / "initial"
    policy.save_checkpoint(str(initial))
    return policy, initial


def values_in(policy, data, mode: str) -> torch.Tensor:
    with driver_batching(policy, mode):
        return policy.get_values(data)["values"]


@pytest.mark.parametrize("mode", ["plain", "packing"])
def test_tp_sp_values_match_hf(tp2, data, llama, mode):
    """tp=2 + sequence parallel: the head all-gathers the sequence; values equal the float64 HF forward."""
    policy, initial = tp2
    reference = load_value_checkpoint(initial)
    assert not head_problems(reference, llama), head_problems(reference, llama)
    with torch.no_grad():
        expected = hf_values(reference, data).float()
    problems = logprob_problems(values_in(policy, data, mode), data["input_lengths"], expected, TOL, what="values")
    assert not problems, "\n".join(problems)


def test_tp_sp_step_checkpoint_and_resume(tp2, data, started, tmp_path):
    """One SGD step of a squared-error loss at tp=2 + SP on packed micro-batches equals the float64 single-process
    step (loss and every weight, the replicated head's included); its checkpoint loads with Hugging Face and gives
    the policy's values; a dp=2 policy resumed from it gives them too."""
    policy, initial = tp2
    loss_fn = SquaredErrorValueLoss()
    oracle = load_value_checkpoint(initial).train()
    before = weights_of(oracle)
    expected_loss = value_sgd_step(oracle, data, loss_fn, LR)
    call_all(policy, "load_checkpoint", str(initial))  # the initial weights, whatever ran before
    with driver_batching(policy, "packing", mb_tokens=40):  # packed micro-batches, several per rank
        loss = float(policy.train(data, loss_fn)["loss"][0])
    assert close(loss, expected_loss, TOL), (loss, expected_loss)
    step = tmp_path / "step1"
    policy.save_checkpoint(str(step))
    saved = load_value_checkpoint(step)
    problems = weight_problems(weights_of(saved), weights_of(oracle), before, TOL, what="value weights (tp2+sp)")
    assert not problems, "\n".join(problems)

    with torch.no_grad():
        from_hf = hf_values(saved, data).float()
        moved = float((from_hf - hf_values(load_value_checkpoint(initial), data).float()).abs().max())
    assert moved > 1e-3, f"the step moved the values by only {moved:.3g}: the comparisons below would be vacuous"
    trained = policy.get_values(data)["values"]
    problems = logprob_problems(trained, data["input_lengths"], from_hf, TOL, what="values vs the saved checkpoint")
    resumed = started("dp2-resumed", weights_path=str(step)).get_values(data)["values"]
    problems += logprob_problems(resumed, data["input_lengths"], from_hf, TOL, what="values of the resumed dp2 run")
    assert not problems, "\n".join(problems)


def test_worker_refuses_refit(tp2):
    """Refit needs a token distribution: the worker refuses it in one line (the Policy refuses it on the driver)."""
    from rlcore.training.value_head import NoTokenDistributionError

    policy, _ = tp2
    with pytest.raises(Exception, match="prepare_refit_info: a value model has no token distribution"):
        call_all(policy, "prepare_refit_info")
    with pytest.raises(NoTokenDistributionError, match="a value model has no token distribution"):
        policy.prepare_refit_info()


def test_value_model_plan_replicates_the_head():
    """No ``lm_head`` to shard; under sequence parallel the head's input is gathered (unless a custom plan says)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput

    from rl_dtensor.tp_plans import decoder_plan, value_model_plan

    plain = value_model_plan(decoder_plan(False), sequence_parallel=False)
    assert "lm_head" not in plain and "score" not in plain and "model.layers.*.mlp.down_proj" in plain
    gathered = value_model_plan(decoder_plan(True), sequence_parallel=True)["score"]
    assert isinstance(gathered, PrepareModuleInput)
    assert gathered.input_layouts == (Shard(1),) and gathered.desired_input_layouts == (Replicate(),)
    own = ColwiseParallel()
    assert value_model_plan({**decoder_plan(True), "score": own}, sequence_parallel=True)["score"] is own
