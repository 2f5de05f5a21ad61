"""Resuming rl-fsdp1 from a forged checkpoint runs no code (design.md §2.8).

A resume reads ``weights/`` through ``AutoModelForCausalLM.from_pretrained``
(safetensors, or ``pytorch_model.bin``, which transformers reads with
``weights_only=True``) and the optimizer directory: DCP shards (read by the same
``rlcore.training.sharded_checkpoint`` code as rl-dtensor's, whose forgeries
test_dtensor_untrusted_checkpoint.py covers) and ``extra_state.pt``, a ``torch.save`` file read by
``rlcore.training.checkpoint.load_torch_state`` (:func:`rlcore.safe_pickle.torch_load`).
Each forged ``extra_state.pt`` below holds a pickle whose execution would create a marker
file; a real worker loads it and must refuse it, naming the file and what
it refused. The genuine checkpoint still resumes.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rlcore.testing.outside_files import OUTSIDE_CASES, assert_load_refuses
from rlcore.testing.payloads import (
    dotted_payload,
    getattr_payload,
    system_payload,
    torch_save_payload,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# --------------------------------------------------------------------------- payloads


#: case → (the forged optimizer file, what the error must say after the file's name)
CASES: dict[str, tuple[Callable[[Path], bytes], str]] = {
    "torch.save-os.system": (
        lambda m: torch_save_payload(m, lambda evil: {"optimizer": evil, "scheduler": {}}),
        "refusing to load posix.system",
    ),
    "legacy-pickle-os.system": (system_payload, "refusing to load os.system"),
    "legacy-pickle-getattr": (getattr_payload, "refusing to load getattr"),  # torch drops 'builtins.'
    "legacy-pickle-protocol-4": (dotted_payload, "refusing to load it"),  # torch's unpickler has no STACK_GLOBAL
}


# --------------------------------------------------------------------------- one policy, many forged loads


def _config(model: str) -> Any:
    from rlcore.config import load_config_dict

    policy = {
        "backend": "fsdp1",
        "model_name": model,
        "train_global_batch_size": 2,
        "train_micro_batch_size": 1,
        "logprob_batch_size": 2,
        "precision": "float32",
        "max_total_sequence_length": 32,
        "max_grad_norm": None,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}},
    }
    return load_config_dict({"cluster": {"workers_per_node": 1}, "policy": policy}).policy


def _losses(policy: Any, batches: list) -> list[float]:
    from rlcore.algorithms.loss_functions import NLLLoss

    return [float(policy.train(b, NLLLoss())["loss"][0]) for b in batches]


def _load(policy: Any, weights: Path, optimizer: Path) -> None:
    group = policy.worker_group
    group.get_results(group.run_all_workers_single_data("load_checkpoint", str(weights), str(optimizer)))


def _chain(exc: BaseException | None) -> str:
    """The text of an exception and of everything it was raised from (a failed start names the cause there)."""
    parts = []
    while exc is not None:
        parts.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


@pytest.fixture(scope="module")
def trained(ray_session: None, tiny_model_dir: str, tiny_tokenizer: Any, tmp_path_factory: Any) -> Any:
    """An fsdp1 policy after one AdamW step, its checkpoint, and the uninterrupted losses of steps 2 and 3."""
    from rlcore.data import BatchedDataDict
    from rlcore.policy import Policy
    from rlcore.testing.models import make_batch
    from rlcore.testing.pytest_plugin import ClusterPool

    root = tmp_path_factory.mktemp("untrusted-fsdp1")
    cfg = _config(tiny_model_dir)
    batches = [BatchedDataDict(make_batch(tiny_tokenizer, 2, 5, 12, seed=s)) for s in (1, 2, 3)]
    clusters = ClusterPool()
    policy = Policy(clusters(1), cfg, tiny_tokenizer, name_prefix="untrusted-fsdp1", init_reference_model=False)
    try:
        _losses(policy, batches[:1])
        policy.save_checkpoint(str(root / "weights"), str(root / "optimizer"))
        later = _losses(policy, batches[1:])
        policy.worker_group.kill_on_error = False  # a refused load must not end the policy
        yield {
            "policy": policy,
            "root": root,
            "batches": batches,
            "later": later,
            "cfg": cfg,
            "clusters": clusters,
            "tokenizer": tiny_tokenizer,
        }
    finally:
        policy.shutdown()
        clusters.shutdown()


@pytest.mark.parametrize("case", sorted(CASES))
def test_load_refuses_forged_optimizer_file(trained: dict, tmp_path: Path, case: str) -> None:
    build, refused = CASES[case]
    marker, optimizer = tmp_path / "payload-ran", tmp_path / "optimizer"
    shutil.copytree(trained["root"] / "optimizer", optimizer)
    forged = optimizer / "extra_state.pt"
    forged.write_bytes(build(marker))
    with pytest.raises(Exception) as err:
        _load(trained["policy"], trained["root"] / "weights", optimizer)
    assert f"{forged}: {refused}" in str(err.value), str(err.value)
    assert not marker.exists()


def test_resume_refuses_forged_pickle_weights(trained: dict, tmp_path: Path) -> None:
    """The ``--resume`` path: ``weights/`` with a forged ``pytorch_model.bin``; the new ``Policy`` reads it with
    the workers' weights-only reader before any worker starts, refuses it in rlcore's words (not torch's advice
    to turn weights_only off) and runs nothing."""
    from rlcore.policy import Policy

    marker, weights = tmp_path / "payload-ran", tmp_path / "weights"
    weights.mkdir()
    shutil.copy(trained["root"] / "weights" / "config.json", weights)
    (weights / "pytorch_model.bin").write_bytes(torch_save_payload(marker, lambda evil: {"lm_head.weight": evil}))
    with pytest.raises(Exception) as err:
        Policy(
            trained["clusters"](1),
            trained["cfg"],
            trained["tokenizer"],
            name_prefix="untrusted-fsdp1-resume",
            weights_path=str(weights),
            optimizer_path=str(trained["root"] / "optimizer"),
            init_reference_model=False,
        )
    assert str(err.value) == (
        f"weights_path: {weights / 'pytorch_model.bin'}: refusing to load posix.system (not "
        "an allowed checkpoint type): pickled weights that name code are never loaded; use "
        "safetensors weights"
    ), _chain(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("case", OUTSIDE_CASES)
def test_load_refuses_files_outside_the_checkpoint(trained: dict, tmp_path: Path, case: str) -> None:
    """An index entry or a link reaching out of the checkpoint (rlcore.testing.outside_files) is refused,
    naming the file, before anything is read."""
    assert_load_refuses(lambda w, o: _load(trained["policy"], w, o), trained["root"], tmp_path, case)


def test_genuine_checkpoint_still_resumes(trained: dict) -> None:
    """Weights and AdamW state come back: steps 2 and 3 repeat exactly (step 3 depends on the moments)."""
    _load(trained["policy"], trained["root"] / "weights", trained["root"] / "optimizer")
    assert _losses(trained["policy"], trained["batches"][1:]) == trained["later"]
