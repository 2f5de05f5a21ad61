"""Non-finite values stop before they reach the weights (issue 45, item 1).

A NaN or infinite reward is a failed sample (reward 0, counted) or, with ``env.on_nonfinite_reward: fail``, the
run's one-line error; a NaN loss or gradient norm skips the optimizer step (weights and optimizer state as they
were, counted), and too many in a row stop the run. The step loop runs in process here: the shared loop of
rlcore.training with a TrainingWorkerBase over a tiny torch model, its optimizer built from a policy-style config.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from rlcore.data import BatchedDataDict
from rlcore.environments.python_reward import PythonRewardConfig
from rlcore.environments.runner import EnvironmentFailed, EnvironmentRunner
from rlcore.training.loop import StepHooks
from rlcore.training.optim import clip_grad_norm_
from rlcore.training.worker_base import NonFiniteStepsError, TrainingWorkerBase

PYTHON_ENV = "rlcore.environments.python_reward:PythonRewardEnvironment"


def rewards_with_nan_and_inf(prompts, completions):
    """The completion's length, except 'nan' scores NaN and 'inf' scores +inf."""
    return [{"nan": math.nan, "inf": math.inf}.get(c, float(len(c))) for c in completions]


def components_with_nan(prompts, completions):
    return {"right": [1.0 if c == "ok" else math.nan for c in completions], "format": [0.5] * len(completions)}


def _logs(*completions):
    return [
        [{"role": "user", "content": f"say something number {i}"}, {"role": "assistant", "content": c}]
        for i, c in enumerate(completions)
    ]


def _python_env(fn, **kwargs):
    return EnvironmentRunner(
        "python", PYTHON_ENV, PythonRewardConfig(reward=f"tests.training.test_nonfinite:{fn}"), **kwargs
    )


def test_a_nan_or_inf_reward_is_a_failed_sample_scored_zero():
    out = _python_env("rewards_with_nan_and_inf").step(_logs("abc", "nan", "inf", "ab"), [{}] * 4)
    assert out.rewards == [3.0, 0.0, 0.0, 2.0]
    assert out.errors[0] is None and out.errors[3] is None
    assert out.errors[1] == "non-finite reward nan from environment 'python'"
    assert out.errors[2] == "non-finite reward inf from environment 'python'"


def test_a_nan_reward_component_fails_its_sample_and_zeroes_its_components():
    out = _python_env("components_with_nan").step(_logs("ok", "bad"), [{}, {}])
    assert out.rewards == [1.5, 0.0]
    assert out.reward_components == {"format": [0.5, 0.0], "right": [1.0, 0.0]}
    assert out.errors[1] == "non-finite reward nan (right=nan) from environment 'python'"


def test_on_nonfinite_reward_fail_stops_in_one_line_naming_the_sample_and_the_environment():
    runner = _python_env("rewards_with_nan_and_inf", on_nonfinite_reward="fail")
    with pytest.raises(EnvironmentFailed) as err:
        runner.step(_logs("abc", "nan", "inf"), [{}] * 3)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(
        "environment 'python' returned a non-finite reward (nan) for sample 1 of a batch of 3 "
        "(prompt 'say something number 1'); 2 such samples; env.on_nonfinite_reward: fail"
    )
    assert runner.step(_logs("abc"), [{}]).rewards == [3.0]  # finite rewards pass


def test_the_rollout_counts_nonfinite_rewards_beside_the_environment_errors(monkeypatch):
    from rlcore.config.data import EnvConfig
    from rlcore.run.rollouts import run_rollout

    assert EnvConfig().on_nonfinite_reward == "zero"
    with pytest.raises(ValueError, match="on_nonfinite_reward"):
        EnvConfig(on_nonfinite_reward="skip")
    metrics = _rollout_metrics(monkeypatch, run_rollout, ["abc", "nan", "inf", "ab"])
    assert metrics["env/errors"] == 2.0 and metrics["env/nonfinite_rewards"] == 2.0
    assert metrics["env/first_error"] == "data row 1: non-finite reward nan from environment 'python'"


def test_the_line_goes_above_the_progress_bar_on_standard_error(tmp_path, capsys):
    """With a progress bar and no terminal given, the line goes where the bar goes (tqdm's own default is stdout,
    where ``rlcore run`` prints its JSON summary)."""
    from rlcore.run.metrics import MetricsLogger, zeroed_line

    row = {"loss": 0.5, "env/errors": 1.0, "env/nonfinite_rewards": 1.0, "env/first_error": "data row 0: nan"}
    logger = MetricsLogger(tmp_path, tensorboard=False, progress_bar=True, total_steps=1)
    logger.log(0, row)
    logger.close()
    captured = capsys.readouterr()
    assert captured.out == "" and zeroed_line(0, row) in captured.err.splitlines()


def test_what_a_step_zeroed_is_one_terminal_line_naming_the_first_sample(tmp_path):
    """30% NaN rewards per step were zeroed and counted, but only metrics.jsonl and the driver log showed it."""
    import io

    from rlcore.run.metrics import MetricsLogger, zeroed_line

    first = "data row 7: non-finite reward nan from environment 'python'"
    row = {"loss": 0.5, "env/errors": 3.0, "env/nonfinite_rewards": 2.0, "env/first_error": first}
    assert zeroed_line(4, row) == (
        f"step 4: 3 samples scored 0 (2 non-finite rewards, 1 environment error); the first, {first}"
    )
    assert zeroed_line(4, {"loss": 0.5, "env/errors": 0.0}) is None
    terminal = io.StringIO()
    logger = MetricsLogger(tmp_path, tensorboard=False, progress_bar=False, progress_file=terminal)
    logger.log(4, row)
    logger.log(5, {"loss": 0.4, "env/errors": 0.0, "env/nonfinite_rewards": 0.0})
    logger.close()
    assert terminal.getvalue().splitlines() == [zeroed_line(4, row)]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["env/first_error"] == first


def _rollout_metrics(monkeypatch, run_rollout, completions):
    """The metrics of a one-turn rollout whose 'engine' answers ``completions`` (a character per token)."""
    from contextlib import nullcontext

    from rlcore.datasets import Sample

    class Tokenizer:
        pad_token_id = 0

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    def generate(batch):
        width = batch["input_ids"].shape[1] + max(len(c) for c in completions)
        out = torch.zeros(len(completions), width, dtype=torch.long)
        lengths = batch["input_lengths"]
        for row, c in enumerate(completions):
            start = int(lengths[row])
            out[row, :start] = batch["input_ids"][row, :start]
            out[row, start : start + len(c)] = torch.tensor([ord(ch) for ch in c])
        return {
            "output_ids": out,
            "logprobs": torch.zeros(out.shape),
            "generation_lengths": torch.tensor([len(c) for c in completions]),
            "unpadded_sequence_lengths": lengths + 0,
        }

    cfg = SimpleNamespace(
        algorithm_section=SimpleNamespace(max_rollout_turns=1), policy=SimpleNamespace(max_total_sequence_length=64)
    )
    n = len(completions)
    samples = [Sample(idx=i, messages=[{"role": "user", "content": f"p{i}"}], metadata={}) for i in range(n)]
    first = {"input_ids": torch.tensor([[1, 2]] * n), "input_lengths": torch.tensor([2] * n)}
    monkeypatch.setattr("rlcore.run.step.encode_samples", lambda *args, **kwargs: first)
    timer = SimpleNamespace(phase=lambda name: nullcontext())
    rollout = run_rollout(cfg, generate, _python_env("rewards_with_nan_and_inf"), Tokenizer(), samples, 1, timer)
    assert rollout.rewards.tolist() == [3.0, 0.0, 0.0, 2.0]
    return rollout.metrics


# -- the optimizer step -------------------------------------------------------------------------------------------

VOCAB = 11


class NLL:
    """Token NLL summed over the step's valid tokens; NaN (and NaN gradients) on a micro-batch holding a
    poisoned row."""

    def __call__(self, logprobs, mb, global_seqs, global_toks):
        mask = mb["token_mask"][:, 1:] * mb["sample_mask"][:, None]
        loss = -(logprobs[:, 1:] * mask).sum() / global_toks
        if bool(mb["poison"].any()):
            loss = loss * math.nan
        return loss, {"loss": float(loss.detach())}


class TinyWorker(TrainingWorkerBase):
    """A one-rank training worker over an embedding table (the logits of each token), AdamW, clipping at 1."""

    def __init__(self, max_consecutive_skipped_steps=3):
        torch.manual_seed(0)
        self.model = torch.nn.Embedding(VOCAB, VOCAB)
        self.device, self.dp_size = torch.device("cpu"), 1
        self.cfg = SimpleNamespace(
            optimizer={"name": "AdamW", "kwargs": {"lr": 0.1}},
            scheduler=None,
            learning_rate=0.1,
            max_grad_norm=1.0,
            make_sequence_length_divisible_by=1,
            train_global_batch_size=2,
            train_micro_batch_size=1,
            logprob_chunk_size=None,
            generation=None,
            max_consecutive_skipped_steps=max_consecutive_skipped_steps,
        )
        self._init_optimizer_and_reference(
            self.model.parameters(),
            init_optimizer=True,
            optimizer_path=None,
            init_reference_model=False,
            load_optimizer=None,
        )

    def _logits(self, mb):
        return self.model(mb["input_ids"])

    def _step_hooks(self):
        params = list(self.model.parameters())
        return StepHooks(
            forward=self._forward_logprobs,
            all_reduce_sum=lambda t: None,
            finish_grads=lambda: None,
            clip_grads=lambda max_norm: clip_grad_norm_(params, max_norm),
            optimizer_step=self._optimizer_step,
            zero_grad=lambda: self.model.zero_grad(set_to_none=True),
        )

    def state(self):
        return (
            {k: v.clone() for k, v in self.model.state_dict().items()},
            {k: (v.clone() if torch.is_tensor(v) else v) for s in self.optimizer.state.values() for k, v in s.items()},
            self.scheduler.last_epoch,
        )


def _batch(steps, poisoned_steps=()):
    """``steps`` global batches of 2 rows each; the rows of ``poisoned_steps`` give a NaN loss."""
    g = torch.Generator().manual_seed(1)
    n = 2 * steps
    return BatchedDataDict(
        input_ids=torch.randint(0, VOCAB, (n, 6), generator=g),
        input_lengths=torch.full((n,), 6),
        token_mask=torch.tensor([[0, 0, 1, 1, 1, 1]] * n, dtype=torch.float32),
        sample_mask=torch.ones(n),
        poison=torch.tensor([float(i // 2 in poisoned_steps) for i in range(n)]),
    )


def _same(a, b):
    weights_a, optim_a, sched_a = a
    weights_b, optim_b, sched_b = b
    return (
        all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
        and sched_a == sched_b
        and optim_a.keys() == optim_b.keys()
        and all(torch.equal(torch.as_tensor(optim_a[k]), torch.as_tensor(optim_b[k])) for k in optim_a)
    )


def test_a_nan_loss_skips_the_step_leaving_weights_and_optimizer_untouched_and_the_next_step_trains():
    worker = TinyWorker()
    worker.train(_batch(1), NLL())  # the optimizer has state now
    before = worker.state()
    result = worker.train(_batch(1, poisoned_steps={0}), NLL())
    assert result["skipped"] == [True] and math.isnan(result["losses"][0]) and math.isnan(result["grad_norms"][0])
    assert _same(worker.state(), before)
    assert all(p.grad is None for p in worker.model.parameters())  # nothing left to leak into the next step
    assert worker.consecutive_skipped == 1
    result = worker.train(_batch(1), NLL())
    assert result["skipped"] == [False] and math.isfinite(result["grad_norms"][0])
    assert not _same(worker.state(), before) and worker.consecutive_skipped == 0
    # the step it took is the one a worker that never saw the NaN step takes from the same state
    twin = TinyWorker()
    twin.train(_batch(1), NLL())
    twin.train(_batch(1), NLL())
    assert _same(worker.state(), twin.state())


def test_a_nan_step_among_others_in_one_call_is_skipped_alone():
    worker = TinyWorker()
    result = worker.train(_batch(3, poisoned_steps={1}), NLL())
    assert result["skipped"] == [False, True, False]
    assert all(torch.isfinite(p).all() for p in worker.model.parameters())
    assert worker.scheduler.last_epoch == 2  # two real steps


def test_an_infinite_gradient_norm_skips_the_step():
    worker = TinyWorker()
    before = worker.state()
    hooks = worker._step_hooks()
    hooks.clip_grads = lambda max_norm: math.inf
    worker._step_hooks = lambda: hooks
    result = worker.train(_batch(1), NLL())
    assert result["skipped"] == [True] and math.isfinite(result["losses"][0])
    assert _same(worker.state(), before)


def test_too_many_skipped_steps_in_a_row_stop_in_one_line():
    worker = TinyWorker(max_consecutive_skipped_steps=2)
    worker.train(_batch(2, poisoned_steps={0}), NLL())  # skipped, then trained: the count starts again
    with pytest.raises(NonFiniteStepsError) as err:
        worker.train(_batch(2, poisoned_steps={0, 1}), NLL())
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        "2 optimizer steps in a row were skipped, the last with loss nan and gradient norm nan "
        "(policy.max_consecutive_skipped_steps=2)"
    )
    never = TinyWorker(max_consecutive_skipped_steps=None)
    assert never.train(_batch(4, poisoned_steps={0, 1, 2, 3}), NLL())["skipped"] == [True] * 4


# -- a real run ----------------------------------------------------------------------------------------------------


def nan_for_the_first_completion(prompts, completions):
    """NaN for the batch's first completion, else 1 for an even length: one NaN reward in every training step."""
    return [math.nan if i == 0 else float(len(c) % 2 == 0) for i, c in enumerate(completions)]


def test_a_run_with_a_nan_reward_trains_on_finite_values_and_saves_finite_weights(ray_session, tmp_path):
    import json

    from safetensors.torch import load_file

    from rlcore.run.train import train
    from tests.support.runs import ONE_WORKER, short_run_config

    summary = train(
        short_run_config(
            tmp_path,
            2,
            **ONE_WORKER,
            **{
                "env.name": "python",
                "env.python_cfg.reward": "tests.training.test_nonfinite:nan_for_the_first_completion",
            },
        )
    )
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["env/nonfinite_rewards"] == 1.0 and row["env/errors"] == 1.0, row
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and math.isfinite(row["reward_mean"])
        assert row["skipped_steps"] == 0.0  # the NaN never reached the loss
    files = sorted((tmp_path / "checkpoints").rglob("*.safetensors"))
    assert files, "no checkpoint was written"
    for file in files:
        for name, tensor in load_file(str(file)).items():
            assert torch.isfinite(tensor.float()).all(), f"{file.relative_to(tmp_path)}: {name} is not finite"
