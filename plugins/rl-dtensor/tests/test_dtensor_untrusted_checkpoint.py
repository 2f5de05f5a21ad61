"""Resuming rl-dtensor from a forged checkpoint runs no code (design.md §2.8).

A resume reads ``weights/`` (safetensors, through transformers or
safetensors) and ``optimizer/``: ``extra_state.pt`` (``torch.save``),
``.metadata`` (DCP's pickled index) and ``__*.distcp`` (DCP's data). Each
forged file below holds a pickle whose execution would create a marker file;
each is put into a copy of a real checkpoint and loaded by a real worker,
which must refuse it, naming the file and what it refused. One case goes
through a new ``Policy`` (the ``--resume`` path itself); the rest reuse one
policy whose workers survive exceptions. The genuine checkpoint still resumes.
"""

from __future__ import annotations

import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from dtensor_testlib import batch as make_batch
from dtensor_testlib import call_all, policy_config

from rlcore.testing.outside_files import OUTSIDE_CASES, assert_load_refuses
from rlcore.testing.payloads import (
    dotted_payload,
    getattr_payload,
    system_payload,
    torch_save_payload,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# --------------------------------------------------------------------------- payloads


# --------------------------------------------------------------------------- forged DCP metadata


def _metadata(optim: Path) -> Any:
    return pickle.loads((optim / ".metadata").read_bytes())  # noqa: S301 - the genuine file we just wrote


def _tensor_key(metadata: Any) -> str:
    return sorted(k for k in metadata.state_dict_metadata if k.endswith("exp_avg"))[0]


def forge_bytes_entry(optim: Path, marker: Path) -> str:
    """Metadata of allowed classes only, calling a tensor entry *bytes*: DCP's default planner
    ``torch.load(weights_only=False)`` s such entries. Returns the entry's name."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
    )

    payload = torch_save_payload(marker)
    (optim / "__9_0.distcp").write_bytes(payload)
    metadata = _metadata(optim)
    key = _tensor_key(metadata)
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data = {i: s for i, s in metadata.storage_data.items() if i.fqn != key}
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("__9_0.distcp", 0, len(payload))
    (optim / ".metadata").write_bytes(pickle.dumps(metadata))
    return key


def forge_tensor_file(optim: Path, marker: Path) -> str:
    """A tensor entry whose data is a forged ``torch.save`` file (torch reads those ``weights_only``)."""
    payload = torch_save_payload(marker)
    (optim / "__9_0.distcp").write_bytes(payload)
    metadata = _metadata(optim)
    key = _tensor_key(metadata)
    for index, info in metadata.storage_data.items():
        if index.fqn == key:
            info.relative_path, info.offset, info.length = "__9_0.distcp", 0, len(payload)
    (optim / ".metadata").write_bytes(pickle.dumps(metadata))
    return key


def forge_path_escape(optim: Path, marker: Path) -> str:
    metadata = _metadata(optim)
    for info in metadata.storage_data.values():
        info.relative_path = "../../../etc/passwd"
    (optim / ".metadata").write_bytes(pickle.dumps(metadata))
    return ""


def forge_truncated_shard(optim: Path, marker: Path) -> str:
    """A shard cut short (a copy interrupted, a disk full): DCP's read runs past its end."""
    shard = optim / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    return shard.name


def _write(name: str, build: Callable[[Path], bytes]) -> Callable[[Path, Path], str]:
    def forge(optim: Path, marker: Path) -> str:
        (optim / name).write_bytes(build(marker))
        return name

    return forge


#: case → (forge the copy of optimizer/, what the error must say besides the file)
CASES: dict[str, tuple[Callable[[Path, Path], str], str]] = {
    "metadata-os.system": (_write(".metadata", system_payload), "refusing to load os.system"),
    "metadata-getattr-chain": (_write(".metadata", getattr_payload), "refusing to load builtins.getattr"),
    "metadata-protocol-4-dotted": (
        _write(".metadata", dotted_payload),
        "refusing to load torch.distributed.checkpoint.filesystem.os.system",
    ),
    "extra_state-torch.save": (
        _write("extra_state.pt", lambda m: torch_save_payload(m, lambda evil: {"optimizer": evil, "scheduler": None})),
        "refusing to load posix.system",
    ),
    "extra_state-legacy-pickle": (_write("extra_state.pt", system_payload), "refusing to load os.system"),
    "distcp-bytes-entry": (forge_bytes_entry, "refusing to unpickle"),
    "distcp-tensor-data": (forge_tensor_file, "posix.system"),
    "metadata-path-escape": (forge_path_escape, "is not in a file of the checkpoint directory"),
    "distcp-truncated": (forge_truncated_shard, "damaged, cannot be read (EOFError"),
}
#: The file of the copy each case's error names. A bytes entry's error names the entry; tensor data is
#: refused by torch's own ``weights_only`` load, and a damaged shard by DCP: those errors name the directory.
NAMES = {
    "extra_state-torch.save": "extra_state.pt",
    "extra_state-legacy-pickle": "extra_state.pt",
    "distcp-bytes-entry": None,
    "distcp-tensor-data": None,
    "distcp-truncated": None,
}


# --------------------------------------------------------------------------- one policy, many forged loads


def _losses(policy: Any, batches: list) -> list[float]:
    from rlcore.algorithms.loss_functions import NLLLoss

    return [float(policy.train(b, NLLLoss())["loss"][0]) for b in batches]


@pytest.fixture(scope="module")
def trained(ray_session: None, tiny_model_dir: str, tiny_tokenizer: Any, tmp_path_factory: Any) -> Any:
    """A dtensor policy after one AdamW step, its checkpoint, and the uninterrupted losses of steps 2 and 3."""
    from rlcore.policy import Policy
    from rlcore.testing.pytest_plugin import ClusterPool

    root = tmp_path_factory.mktemp("untrusted-dtensor")
    cfg = policy_config(tiny_model_dir, world=1, optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}})
    batches = [make_batch(tiny_tokenizer, seed=s) for s in (1, 2, 3)]
    clusters = ClusterPool()
    policy = Policy(clusters(1), cfg, tiny_tokenizer, name_prefix="untrusted-dt", init_reference_model=False)
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


def _forged_copy(trained: dict, tmp_path: Path, case: str) -> tuple[Path, Path, str]:
    optim = tmp_path / "optimizer"
    shutil.copytree(trained["root"] / "optimizer", optim)
    marker = tmp_path / "payload-ran"
    forge, _ = CASES[case]
    return optim, marker, forge(optim, marker)


def test_control_forged_bytes_entry_runs_under_stock_dcp(trained: dict, tmp_path: Path) -> None:
    """Stock DCP (default reader and planner) runs the forged bytes entry: the refusal below is not vacuous."""
    import torch.distributed.checkpoint as dcp

    optim, marker, key = _forged_copy(trained, tmp_path, "distcp-bytes-entry")
    state = {key: torch.zeros(1)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(optim), no_dist=True)
    assert marker.exists()


@pytest.mark.parametrize("case", sorted(CASES))
def test_load_refuses_forged_optimizer_file(trained: dict, tmp_path: Path, case: str) -> None:
    optim, marker, forged = _forged_copy(trained, tmp_path, case)
    with pytest.raises(Exception) as err:
        call_all(trained["policy"], "load_checkpoint", str(trained["root"] / "weights"), str(optim))
    message = str(err.value)
    assert CASES[case][1] in message and str(optim) in message, message
    # rlcore's words only: not DCP's folded tracebacks, not torch's advice to turn weights_only off
    assert not any(noise in message for noise in ("metadata is None", "CheckpointException", "weights_only")), message
    name = NAMES.get(case, ".metadata")
    if name:
        assert str(optim / name) in message, message
    elif case == "distcp-bytes-entry":
        assert f"{optim}: refusing to unpickle {forged!r}" in message, message
    assert not marker.exists()


def test_resume_refuses_forged_metadata(trained: dict, tmp_path: Path) -> None:
    """The ``--resume`` path: a new ``Policy`` given the forged checkpoint fails to start, and runs nothing."""
    from rlcore.policy import Policy

    optim, marker, _ = _forged_copy(trained, tmp_path, "metadata-getattr-chain")
    with pytest.raises(Exception) as err:
        Policy(
            trained["clusters"](1),
            trained["cfg"],
            trained["tokenizer"],
            name_prefix="untrusted-dt-resume",
            weights_path=str(trained["root"] / "weights"),
            optimizer_path=str(optim),
            init_reference_model=False,
        )
    assert f"{optim / '.metadata'}: refusing to load builtins.getattr" in str(err.value), str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("case", OUTSIDE_CASES)
def test_load_refuses_files_outside_the_checkpoint(trained: dict, tmp_path: Path, case: str) -> None:
    """An index entry or a link reaching out of the checkpoint (rlcore.testing.outside_files) is refused,
    naming the file, before anything is read."""
    assert_load_refuses(
        lambda w, o: call_all(trained["policy"], "load_checkpoint", str(w), str(o)), trained["root"], tmp_path, case
    )


def test_genuine_checkpoint_still_resumes(trained: dict) -> None:
    """Weights and AdamW state come back: steps 2 and 3 repeat exactly (step 3 depends on the moments)."""
    root = trained["root"]
    call_all(trained["policy"], "load_checkpoint", str(root / "weights"), str(root / "optimizer"))
    assert _losses(trained["policy"], trained["batches"][1:]) == trained["later"]
