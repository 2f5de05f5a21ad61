"""DPO's reference logprobs computed several batches per weight swap (rlcore.algorithms.dpo.reference): the
losses, gradients and weights of steps with the cache equal those of the step-by-step path, the reference
logprobs equal a float64 recomputation, and the swaps (counted on the real worker's swap) drop.

No Ray: the reference backend's worker runs in this process (a one-rank gloo group) behind a thin policy that
calls it as the Ray policy would."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from rlcore.algorithms.dpo.loop import dpo_step, dpo_validate
from rlcore.algorithms.dpo.reference import ReferenceLogprobs
from tests.algorithms.test_dpo_run import dpo_config


class InProcessPolicy:
    """The calls DPO makes of a Policy, on one in-process worker; counts the worker's reference swaps."""

    def __init__(self, worker):
        self.worker, self.swaps = worker, 0
        swap = worker.use_reference_model

        def counted():
            self.swaps += 1
            return swap()

        worker.use_reference_model = counted

    def prepare_for_lp_inference(self):
        self.worker.prepare_for_lp_inference()

    def prepare_for_training(self):
        self.worker.prepare_for_training()

    def finish_training(self):
        self.worker.finish_training()

    def get_reference_policy_logprobs(self, data):
        return self.worker.get_reference_policy_logprobs(data)

    def train(self, data, loss_fn, eval_mode=False, *, gbs=None, mbs=None):
        out = self.worker.train(data, loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs)
        mb = out["all_mb_metrics"]
        return {
            "loss": torch.tensor(out["losses"]),
            "grad_norm": torch.tensor(out["grad_norms"]),
            "metrics": {k: sum(v) for k, v in mb.items()},
        }


@pytest.fixture(scope="module")
def process_group():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_run(tmp_path, tiny_tokenizer, steps=4):
    """A DPO run of the tiny model on one in-process reference-backend worker, ``steps`` batches of 2 pairs."""
    from rlcore.backends.reference.worker import ReferenceWorker
    from rlcore.config import resolve
    from rlcore.run.build import Run, load_run_data

    tmp_path.mkdir(parents=True, exist_ok=True)
    resolved = resolve(
        dpo_config(
            tmp_path,
            **{
                "policy.dynamic_batching.enabled": "false",
                "cluster.workers_per_node": "1",
                "policy.train_global_batch_size": "2",
                "policy.precision": "float32",
                "dpo.max_num_steps": str(steps),
                "dpo.val_global_batch_size": "2",
            },
        ),
        run=True,
    )
    cfg = resolved.config
    data = load_run_data(cfg, tiny_tokenizer)
    data.validation = [data.train.batch(0)[0], data.train.batch(1)[1], data.train.batch(2)[0]]
    torch.manual_seed(0)
    worker = ReferenceWorker(cfg.policy, tiny_tokenizer)
    return Run(
        resolved=resolved,
        cluster=None,
        policy=InProcessPolicy(worker),
        tokenizer=tiny_tokenizer,
        data=data,
        num_steps=steps,
    )


def train_steps(run, reference):
    """Each step's metrics and, after each, the gradient-free weights' fingerprint (a sum per parameter)."""
    rows = []
    for _ in range(run.num_steps):
        metrics = dpo_step(run, reference)
        rows.append((metrics, torch.stack([p.detach().double().sum() for p in run.policy.worker.model.parameters()])))
    return rows


def test_the_cache_trains_the_same_steps_with_fewer_swaps(tmp_path, tiny_tokenizer, process_group):
    uncached = make_run(tmp_path / "a", tiny_tokenizer, steps=3)
    before = train_steps(uncached, None)
    validation_before = dpo_validate(uncached)
    cached = make_run(tmp_path / "b", tiny_tokenizer, steps=3)
    reference = ReferenceLogprobs(cached, batches_per_swap=2)
    after = train_steps(cached, reference)
    validation_after = [dpo_validate(cached, reference) for _ in range(2)]

    assert uncached.policy.swaps == 3 + 2  # a swap per step, and per validation batch
    assert cached.policy.swaps == 2 + 1  # steps 0-1 in one swap, step 2 in another; validation's once per run
    for (m0, w0), (m1, w1) in zip(before, after):
        for name in (
            "loss",
            "grad_norm",
            "preference_loss",
            "sft_loss",
            "rewards_chosen_mean",
            "rewards_rejected_mean",
            "accuracy",
        ):
            assert m1[name] == pytest.approx(m0[name], rel=1e-5, abs=1e-6), name
        torch.testing.assert_close(w1, w0, rtol=1e-6, atol=1e-6)  # the gradients took the same steps
    assert before[1][0]["loss"] != pytest.approx(before[0][0]["loss"])  # training moved: the check can fail
    for validation in validation_after:
        for name, value in validation_before.items():
            if not name.startswith("time/"):
                assert validation[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_reference_logprobs_computed_ahead_equal_a_float64_recomputation(tmp_path, tiny_tokenizer, process_group):
    from transformers import AutoModelForCausalLM

    from rlcore.algorithms.dpo.batches import dpo_batch

    run = make_run(tmp_path, tiny_tokenizer, steps=3)
    reference = ReferenceLogprobs(run, batches_per_swap=3)
    initial = AutoModelForCausalLM.from_pretrained(run.cfg.policy.model_name, torch_dtype=torch.float64)
    batches = [dpo_batch(run.data.train.batch(k), tiny_tokenizer, run.cfg) for k in range(3)]
    for k, batch in enumerate(batches):
        values = reference.for_train_batch(k, batch)
        dpo_step(run, None)  # the weights move: values computed ahead must still be the initial weights'
        ids = batch["input_ids"]
        with torch.no_grad():
            logits = initial(ids).logits
        expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        mask = batch["token_mask"][:, 1:].bool()
        assert values.shape == ids.shape
        torch.testing.assert_close(values[:, 1:][mask].double(), expected[mask], rtol=1e-4, atol=1e-4)
    assert run.policy.swaps == 1 + 3  # the three batches' reference logprobs in one swap; a swap per plain step


def test_a_batch_encoded_otherwise_than_ahead_is_refused(tmp_path, tiny_tokenizer, process_group):
    from rlcore.algorithms.dpo.batches import dpo_batch

    run = make_run(tmp_path, tiny_tokenizer, steps=2)
    reference = ReferenceLogprobs(run, batches_per_swap=2)
    reference.for_train_batch(0, dpo_batch(run.data.train.batch(0), tiny_tokenizer, run.cfg))
    with pytest.raises(RuntimeError, match="training batch 1 was encoded differently"):
        reference.for_train_batch(1, dpo_batch(run.data.train.batch(0), tiny_tokenizer, run.cfg))
