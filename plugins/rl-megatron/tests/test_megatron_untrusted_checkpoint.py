"""Resuming rl-megatron from a forged checkpoint runs no code (design.md §2.8).

A resume reads ``weights/`` (``config.json``, safetensors) and the megatron
distributed checkpoint in ``optimizer/``: ``rlcore_megatron.json`` and
``metadata.json`` (JSON), ``common.pt`` (``torch.save``), ``.metadata`` (DCP's
pickled index) and ``__*.distcp`` (tensors, and pickled sharded objects such as
every layer's ``_extra_state``). megatron-core 0.16.1 reads ``.metadata`` with
plain ``pickle`` and the sharded objects with ``torch.load(weights_only=False)``;
:mod:`rl_megatron.safe_load` replaces both. Each forged file below holds a
pickle whose execution would create a marker file; each is put into a copy of
a real checkpoint and loaded by a real worker, which must refuse it, naming
the file (or entry) and what it refused. One case goes through a new
``Policy`` (the ``--resume`` path itself). The genuine checkpoint still resumes.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from megatron_helpers import batch, call_workers, model_dir, policy_config

from rlcore.testing.outside_files import OUTSIDE_CASES, assert_load_refuses
from rlcore.testing.payloads import (
    dotted_payload,
    getattr_payload,
    system_payload,
    torch_save_payload,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# --------------------------------------------------------------------------- payloads


# --------------------------------------------------------------------------- forging a copy of optimizer/


def _metadata(optim: Path) -> Any:
    return pickle.loads((optim / ".metadata").read_bytes())  # noqa: S301 - the genuine file we just wrote


def _first_key(metadata: Any, kind: str) -> str:
    return sorted(k for k, v in metadata.state_dict_metadata.items() if type(v).__name__ == kind)[0]


def _redirect(optim: Path, key: str, payload: bytes) -> str:
    """Point every chunk of entry ``key`` at a new data file holding ``payload``; metadata of allowed classes."""
    (optim / "__9_0.distcp").write_bytes(payload)
    metadata = _metadata(optim)
    for index, info in metadata.storage_data.items():
        if index.fqn == key:
            info.relative_path, info.offset, info.length = "__9_0.distcp", 0, len(payload)
    (optim / ".metadata").write_bytes(pickle.dumps(metadata))
    return key


def forge_sharded_object(optim: Path, marker: Path) -> str:
    """A genuine bytes entry (a layer's ``_extra_state``) whose pickle runs a command."""
    return _redirect(
        optim, _first_key(_metadata(optim), "BytesStorageMetadata"), torch_save_payload(marker, lambda evil: [evil])
    )


def forge_tensor_data(optim: Path, marker: Path) -> str:
    return _redirect(optim, _first_key(_metadata(optim), "TensorStorageMetadata"), torch_save_payload(marker))


def forge_path_escape(optim: Path, marker: Path) -> str:
    metadata = _metadata(optim)
    for info in metadata.storage_data.values():
        info.relative_path = "../../../etc/passwd"
    (optim / ".metadata").write_bytes(pickle.dumps(metadata))
    return ".metadata"


def forge_backend(optim: Path, marker: Path) -> str:
    """``metadata.json`` picks megatron's loader; here it cannot pick another."""
    config = json.loads((optim / "metadata.json").read_text())
    (optim / "metadata.json").write_text(json.dumps({**config, "sharded_backend": "zarr"}))
    return "metadata.json"


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


#: case → (forge the copy of optimizer/, what the error must say)
CASES: dict[str, tuple[Callable[[Path, Path], str], str]] = {
    "metadata-os.system": (_write(".metadata", system_payload), "{optim}/.metadata: refusing to load os.system"),
    "metadata-getattr-chain": (
        _write(".metadata", getattr_payload),
        "{optim}/.metadata: refusing to load builtins.getattr",
    ),
    "metadata-protocol-4-dotted": (
        _write(".metadata", dotted_payload),
        "{optim}/.metadata: refusing to load torch.distributed.checkpoint.filesystem.os",
    ),
    "metadata-path-escape": (forge_path_escape, "{optim}/.metadata: the data of"),
    "common.pt-torch.save": (
        _write("common.pt", lambda m: torch_save_payload(m, lambda evil: {"optimizer": evil})),
        "{optim}/common.pt: refusing to load posix.system",
    ),
    "common.pt-legacy-pickle": (_write("common.pt", system_payload), "{optim}/common.pt: refusing to load os.system"),
    "distcp-sharded-object": (forge_sharded_object, "{optim} (object '{forged}'): refusing to load posix.system"),
    # torch's own weights_only load refuses tensor data inside DCP: the error names the directory
    "distcp-tensor-data": (forge_tensor_data, "{optim}: refusing to load posix.system (not an allowed"),
    "distcp-truncated": (forge_truncated_shard, "{optim}: damaged, cannot be read (EOFError"),
    "metadata.json-backend": (forge_backend, "sharded backend 'zarr': rl-megatron reads only 'torch_dist'"),
}


# --------------------------------------------------------------------------- one policy, many forged loads


def _losses(policy: Any, batches: list) -> list[float]:
    from rlcore.algorithms.loss_functions import NLLLoss

    return [float(policy.train(b, NLLLoss())["loss"][0]) for b in batches]


@pytest.fixture(scope="module")
def trained(ray_session: None, tiny_tokenizer: Any, tmp_path_factory: Any) -> Any:
    """A megatron policy after one Adam step, its checkpoint, and the uninterrupted losses of steps 2 and 3."""
    from rlcore.policy import Policy
    from rlcore.testing.pytest_plugin import ClusterPool

    root = tmp_path_factory.mktemp("untrusted-megatron")
    cfg = policy_config(model_dir("llama"), 1, lr=1e-2, megatron={"optimizer": {"optimizer": "adam"}})
    batches = [batch(tiny_tokenizer, seed=s) for s in (1, 2, 3)]
    clusters = ClusterPool()
    policy = Policy(clusters(1), cfg, tiny_tokenizer, name_prefix="untrusted-mg", init_reference_model=False)
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


def test_the_checkpoint_has_what_the_cases_forge(trained: dict) -> None:
    optim = trained["root"] / "optimizer"
    assert {p.name for p in optim.iterdir()} >= {".metadata", "common.pt", "metadata.json", "__0_0.distcp"}
    kinds = {type(v).__name__ for v in _metadata(optim).state_dict_metadata.values()}
    assert kinds == {"TensorStorageMetadata", "BytesStorageMetadata"}


def test_control_forged_sharded_object_runs_under_stock_dcp(trained: dict, tmp_path: Path) -> None:
    """DCP's default reader and planner (what megatron-core uses) run the forged sharded object."""
    import torch.distributed.checkpoint as dcp

    optim, marker, key = _forged_copy(trained, tmp_path, "distcp-sharded-object")
    dcp.load({key: io.BytesIO()}, storage_reader=dcp.FileSystemReader(optim), no_dist=True)
    assert marker.exists()


@pytest.mark.parametrize("case", sorted(CASES))
def test_load_refuses_forged_checkpoint_file(trained: dict, tmp_path: Path, case: str) -> None:
    optim, marker, forged = _forged_copy(trained, tmp_path, case)
    with pytest.raises(Exception) as err:
        call_workers(trained["policy"], "load_checkpoint", str(trained["root"] / "weights"), str(optim))
    expected = CASES[case][1].format(optim=optim, forged=forged)
    message = str(err.value)
    assert expected in message, message
    # rlcore's words only: not DCP's folded tracebacks, not torch's advice to turn weights_only off
    assert not any(noise in message for noise in ("metadata is None", "CheckpointException", "weights_only")), message
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
            name_prefix="untrusted-mg-resume",
            weights_path=str(trained["root"] / "weights"),
            optimizer_path=str(optim),
            init_reference_model=False,
        )
    assert f"{optim}/.metadata: refusing to load builtins.getattr" in str(err.value), str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("case", OUTSIDE_CASES)
def test_load_refuses_files_outside_the_checkpoint(trained: dict, tmp_path: Path, case: str) -> None:
    """An index entry or a link reaching out of the checkpoint (rlcore.testing.outside_files) is refused,
    naming the file, before anything is read."""
    assert_load_refuses(
        lambda w, o: call_workers(trained["policy"], "load_checkpoint", str(w), str(o)), trained["root"], tmp_path, case
    )


def test_genuine_checkpoint_still_resumes(trained: dict) -> None:
    """Weights, Adam state and scheduler come back: steps 2 and 3 repeat exactly."""
    root = trained["root"]
    call_workers(trained["policy"], "load_checkpoint", str(root / "weights"), str(root / "optimizer"))
    assert _losses(trained["policy"], trained["batches"][1:]) == trained["later"]
