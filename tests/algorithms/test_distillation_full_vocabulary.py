"""Distillation with ``zero_outside_topk: true`` and the loss inputs it rests on (``logprobs_at_indices``,
``entropy``): the loss and its gradient against a float64 recomputation over the whole vocabulary, the inputs
from the dtensor backend's padded and packed layouts, and the refusal at config time of a student backend that
does not compute them. (A vocabulary split over a gloo group: tests/algorithms/test_distillation.py, one spawn for all
three inputs.)"""

from __future__ import annotations

import pytest
import torch

from rlcore.algorithms.distillation import TEACHER_LOGITS_KEY, DistillationLossFn
from rlcore.interfaces.loss import ENTROPY, LOGIT_INDICES_KEY, LOGITS_AT_INDICES, LOGPROBS_AT_INDICES
from rlcore.training.loss_inputs import compute_loss_inputs

VOCAB = 23


def _batch(seed: int = 0, batch: int = 3, seq: int = 7, k: int = 4) -> dict:
    """Whole-vocabulary student logits (column ``t`` predicts token ``t + 1``) and a teacher's top-k, aligned."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 4, 5])[:batch]
    token_mask = (torch.arange(seq)[None, :] >= 2).float() * (torch.arange(seq)[None, :] < lengths[:, None])
    indices = torch.rand(batch, seq, VOCAB, generator=gen).topk(k, dim=-1).indices  # distinct ids per position
    # peaked logits on the teacher's ids, so the student's mass outside them is neither ~0 nor ~1
    logits = torch.randn(batch, seq, VOCAB, generator=gen, dtype=torch.float64)
    logits.scatter_add_(
        -1, torch.cat([indices[:, 1:], indices[:, :1]], 1), torch.full((batch, seq, k), 2.0, dtype=torch.float64)
    )
    return {
        "input_ids": torch.zeros(batch, seq, dtype=torch.long),
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0, 1.0, 0.0]),
        LOGIT_INDICES_KEY: indices,
        TEACHER_LOGITS_KEY: torch.randn(batch, seq, k, generator=gen, dtype=torch.float64) * 2,
        "logits": logits,
    }


def _nemo_kl_float64(data: dict, logits: torch.Tensor, kl_type: str, weight: float) -> torch.Tensor:
    """NeMo-RL's ``zero_outside_topk`` KL summed over valid tokens, written over the whole vocabulary in float64:
    the teacher renormalised over its top-k and given log-probability -100 elsewhere (reverse KL only); the
    student's full-vocabulary softmax, not renormalised."""
    total = torch.zeros((), dtype=torch.float64)
    for b in range(logits.shape[0]):
        if not data["sample_mask"][b]:
            continue
        for t in range(1, int(data["input_lengths"][b])):
            if not data["token_mask"][b, t]:
                continue
            log_s = torch.log_softmax(logits[b, t - 1], -1)
            ids = data[LOGIT_INDICES_KEY][b, t]
            log_t_topk = torch.log_softmax(data[TEACHER_LOGITS_KEY][b, t], -1)
            forward = (log_t_topk.exp() * (log_t_topk - log_s[ids])).sum()
            log_t = torch.full((VOCAB,), -100.0, dtype=torch.float64)
            log_t[ids] = log_t_topk
            reverse = (log_s.exp() * (log_s - log_t)).sum()
            w = {"forward": 1.0, "reverse": 0.0, "mixed": weight}[kl_type]
            total = total + w * forward + (1 - w) * reverse
    return total


@pytest.mark.parametrize("kl_type, weight", [("forward", 0.5), ("reverse", 0.5), ("mixed", 0.3)])
def test_zero_outside_topk_and_its_gradient_match_a_float64_recomputation(kl_type, weight):
    data = _batch()
    loss_fn = DistillationLossFn({"kl_type": kl_type, "mixed_kl_weight": weight, "zero_outside_topk": True})
    assert loss_fn.inputs == ((LOGPROBS_AT_INDICES,) if kl_type == "forward" else (LOGPROBS_AT_INDICES, ENTROPY))
    logits = data["logits"].clone().requires_grad_(True)
    inputs = compute_loss_inputs(logits, data, loss_fn.inputs)  # what a backend gives the loss
    loss, metrics = loss_fn(torch.zeros(3, 7), {**data, **inputs}, torch.tensor(2.0), torch.tensor(6.0))
    loss.backward()
    reference = data["logits"].clone().requires_grad_(True)
    expected = _nemo_kl_float64(data, reference, kl_type, weight) / 6.0
    expected.backward()
    assert abs(float(loss.detach()) - float(expected)) < 1e-5 * max(1.0, abs(float(expected)))
    assert (logits.grad - reference.grad).abs().max() < 1e-5
    assert float(expected) > 1.0  # the mass outside the top-k is scored (renormalised KLs are far smaller)
    assert metrics["num_valid_tokens"] == float((data["token_mask"][:2, 1:]).sum())


def test_without_zero_outside_topk_the_loss_asks_for_the_logits_at_the_ids_only():
    assert DistillationLossFn().inputs == (LOGITS_AT_INDICES,)
    assert DistillationLossFn({"zero_outside_topk": False, "kl_type": "reverse"}).inputs == (LOGITS_AT_INDICES,)


def test_an_empty_top_k_is_refused_under_zero_outside_topk_too():
    data = _batch(k=1)
    data = {
        **data,
        LOGPROBS_AT_INDICES: torch.zeros(3, 7, 0),
        TEACHER_LOGITS_KEY: torch.zeros(3, 7, 0),
        ENTROPY: torch.zeros(3, 7),
    }
    with pytest.raises(ValueError, match=r"data\['logprobs_at_indices'\] has an empty top-k"):
        DistillationLossFn({"zero_outside_topk": True})(torch.zeros(3, 7), data, torch.tensor(2.0), torch.tensor(6.0))


def test_the_inputs_take_the_previous_position_and_zero_padding():
    data = _batch()
    out = compute_loss_inputs(data["logits"], data, (LOGPROBS_AT_INDICES, ENTROPY))
    assert out[LOGPROBS_AT_INDICES].dtype == out[ENTROPY].dtype == torch.float32
    for b in range(3):
        for t in range(7):
            log_s = torch.log_softmax(data["logits"][b, t - 1], -1)
            valid = 1 <= t < int(data["input_lengths"][b])
            want_lp = log_s[data[LOGIT_INDICES_KEY][b, t]] if valid else torch.zeros(4, dtype=torch.float64)
            want_h = -(log_s.exp() * log_s).sum() if valid else torch.zeros((), dtype=torch.float64)
            assert (out[LOGPROBS_AT_INDICES][b, t].double() - want_lp).abs().max() < 1e-5, (b, t)
            assert abs(float(out[ENTROPY][b, t]) - float(want_h)) < 1e-5, (b, t)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_dtensor_backend_s_layouts_give_the_same_inputs(packed: bool):
    """rl_dtensor's ``ModelInputs.loss_input`` from the forward's own layout (padded, or packed into one row)
    equals the whole-batch computation of :mod:`rlcore.training.loss_inputs`."""
    pytest.importorskip("rl_dtensor")
    from rl_dtensor.inputs import packed_inputs, padded_inputs

    data = _batch()
    data["input_ids"] = torch.randint(1, VOCAB, (3, 7), generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    table = torch.randn(VOCAB, VOCAB, generator=gen)  # logits from the current token: layout-independent
    if packed:
        inputs = packed_inputs(data, torch.device("cpu"), "sdpa", torch.float32, multiple=4)
    else:
        inputs = padded_inputs(data, torch.device("cpu"), multiple=4)
    names = (LOGITS_AT_INDICES, LOGPROBS_AT_INDICES, ENTROPY)
    expected = compute_loss_inputs(table[data["input_ids"]], data, names)
    for name in names:
        got = inputs.loss_input(name, table[inputs.input_ids], data)
        assert got.shape == expected[name].shape, name
        assert (got - expected[name]).abs().max() < 1e-5, name


def test_a_student_backend_without_the_full_vocabulary_inputs_is_refused_by_name(tmp_path, rlcore_registry):
    from rlcore.config import ConfigError, resolve
    from rlcore.plugins import BackendSpec, hookimpl
    from tests.algorithms.test_distillation import _distillation_config

    class TopkOnlyPlugin:
        @hookimpl
        def rlcore_register_backends(self, register):
            register(
                BackendSpec(
                    name="topk_only",
                    kind="training",
                    worker_class="rlcore.backends.reference.worker:ReferenceWorker",
                    capabilities={"train", "logprobs", "topk_logits", "generate", "logits_at_indices"},
                )
            )

    import rlcore.environments.plugin as environments

    rlcore_registry.register_plugin(TopkOnlyPlugin(), name="topk_only")
    rlcore_registry.register_plugin(environments, name="environments")
    overrides = {"policy.backend": "topk_only", "policy.generation.backend": "topk_only"}
    resolve(_distillation_config(tmp_path, **overrides), run=True, registry=rlcore_registry)  # renormalised: fine
    cfg = _distillation_config(tmp_path, **overrides, **{"distillation.zero_outside_topk": "true"})
    with pytest.raises(
        ConfigError,
        match=r"distillation: the 'topk_only' training backend does not declare "
        r"'logprobs_at_indices', a loss input distillation trains on "
        r"\(distillation.zero_outside_topk: true\)",
    ):
        resolve(cfg, run=True, registry=rlcore_registry)


def test_nemo_rls_distillation_yaml_with_zero_outside_topk_converts_and_resolves(tmp_path):
    """NeMo-RL accepts ``loss_fn.zero_outside_topk: true``; so does the converter now, and the dtensor student
    computes the inputs it needs."""
    import json

    from rlcore.config import resolve
    from tests.nemo_rl.test_nemo_rl_dpo_distillation import DISTILLATION_MAIN, nemo_distillation

    rows = tmp_path / "math.jsonl"
    rows.write_text(
        "".join(json.dumps({"problem": f"What is {a} + 1?", "answer": str(a + 1)}) + "\n" for a in range(8))
    )
    loaded = nemo_distillation(DISTILLATION_MAIN, rows, ["loss_fn.zero_outside_topk=true"])
    d = loaded.config.distillation
    assert (d.zero_outside_topk, d.kl_type) == (True, "mixed")
    assert DistillationLossFn(d.loss_settings()).inputs == (LOGPROBS_AT_INDICES, ENTROPY)
    assert resolve(loaded.config, run=True).teacher is not None


# --- the teacher's own settings (distillation.teacher) ----------------------------------------------------------


def _nemo_rows(tmp_path):
    import json

    rows = tmp_path / "math.jsonl"
    rows.write_text(
        "".join(json.dumps({"problem": f"What is {a} + 1?", "answer": str(a + 1)}) + "\n" for a in range(8))
    )
    return rows


#: NeMo-RL's distillation_math.yaml at CPU size: the student tp 1, the teacher tp 2 (its own, as the example's
#: teacher has a tp of its own), no context parallel (CUDA only), two CPU workers.
CPU_SIZE = [
    "policy.model_name=tiny-llama",
    "teacher.model_name=tiny-teacher",
    "policy.dtensor_cfg.tensor_parallel_size=1",
    "policy.dtensor_cfg.context_parallel_size=1",
    "teacher.dtensor_cfg.tensor_parallel_size=2",
    "teacher.dtensor_cfg.context_parallel_size=1",
    "checkpointing.save_period=20",
]


def test_nemo_rls_teacher_is_a_policy_of_its_own_layout(tmp_path):
    from rlcore.config import resolve
    from rlcore.nemo_rl import load_nemo_rl_config
    from tests.nemo_rl.test_nemo_rl_dpo_distillation import DISTILLATION_MAIN, distillation_data

    rows = _nemo_rows(tmp_path)
    loaded = load_nemo_rl_config(
        DISTILLATION_MAIN,
        [*distillation_data(DISTILLATION_MAIN, rows), *CPU_SIZE],
        ["cluster.use_gpu=false", "cluster.workers_per_node=2"],
    )
    assert loaded.config.distillation.teacher == {
        "dtensor_cfg": {"tensor_parallel_size": 2},
        "make_sequence_length_divisible_by": 4,
    }
    resolved = resolve(loaded.config, run=True)
    student, teacher = resolved.policy, resolved.teacher
    assert (student.layout.tp, student.data_parallel_size) == (1, 2)
    assert (teacher.layout.tp, teacher.data_parallel_size) == (2, 1)
    assert teacher.config.model_name != student.config.model_name and teacher.config.generation is None
    # everything the teacher does not set is the student's
    s_cfg, t_cfg = student.config.backend_sections["dtensor_cfg"], teacher.config.backend_sections["dtensor_cfg"]
    assert {k: v for k, v in t_cfg.items() if k != "tensor_parallel_size"} == {
        k: v for k, v in s_cfg.items() if k != "tensor_parallel_size"
    }
    assert (teacher.config.precision, teacher.config.logprob_batch_size) == (
        student.config.precision,
        student.config.logprob_batch_size,
    )
    assert teacher.config.make_sequence_length_divisible_by == 4 != student.config.make_sequence_length_divisible_by


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            {"distillation.teacher.generation.temperature": "0.5"},
            "distillation.teacher.generation is not the teacher's own setting: the teacher does not generate; "
            "remove it",
        ),
        (
            {"distillation.teacher.model_name": "x"},
            "distillation.teacher.model_name is not the teacher's own setting: set distillation.teacher_model_name",
        ),
        (
            {"distillation.teacher.backend": "dtensor", "distillation.teacher.dtensor_cfg.tensor_parallel_size": "3"},
            "distillation.teacher.dtensor_cfg.tensor_parallel_size",
        ),
    ],
    ids=["generation", "model_name", "layout"],
)
def test_a_teacher_setting_that_cannot_be_its_own_is_refused_by_its_path(tmp_path, overrides, line):
    from rlcore.config import ConfigError, resolve
    from tests.algorithms.test_distillation import _distillation_config

    with pytest.raises(ConfigError) as info:
        resolve(_distillation_config(tmp_path, **overrides), run=True)
    assert any(line in p for p in info.value.problems), info.value.problems


@pytest.mark.slow
def test_rlcore_run_from_nemo_rls_distillation_yaml_trains_with_the_teacher_s_own_layout(tmp_path):
    """NeMo-RL's distillation_math.yaml (main) as a user runs it, with only data, model and CPU-size overrides: the
    teacher keeps a tensor-parallel size of its own (2 against the student's 1) and the student trains 2 steps
    (about 4 minutes on two busy CPU cores, hence slow)."""
    import json
    import subprocess
    import sys

    from tests.nemo_rl.test_nemo_rl_dpo_distillation import DISTILLATION_MAIN, distillation_data

    rows = _nemo_rows(tmp_path)
    overrides = [
        *distillation_data(DISTILLATION_MAIN, rows),
        *CPU_SIZE,
        "policy.precision=float32",
        "teacher.precision=float32",
        "checkpointing.enabled=false",
        "distillation.max_num_steps=2",
        "distillation.num_prompts_per_step=4",
        "distillation.topk_logits_k=8",
        "policy.train_global_batch_size=4",
        "policy.train_micro_batch_size=2",
        "policy.max_total_sequence_length=64",
        "distillation.val_batch_size=4",
        "distillation.max_val_samples=4",
        "env.math.num_workers=1",
        "logger.wandb_enabled=false",
        f"logger.log_dir={tmp_path / 'run'}",
    ]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcore",
            "run",
            "--from",
            "nemo-rl",
            str(DISTILLATION_MAIN),
            *overrides,
            "-o",
            "cluster.use_gpu=false",
            "-o",
            "cluster.workers_per_node=2",
            "-o",
            "logger.progress_bar=false",
            "-o",
            "policy.generation.max_new_tokens=8",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["forward_kl"] > 0 and r["reverse_kl"] > 0 for r in logged if "forward_kl" in r)
