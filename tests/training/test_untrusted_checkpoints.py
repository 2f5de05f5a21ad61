"""A checkpoint directory is untrusted input: reading one must never run code (design.md §2.8).

Every payload here is a pickle whose execution would create a marker file
(``os.system("touch …")``): named directly, reached through
``builtins.getattr`` and the ``os`` a DCP module imports, or named with a
dotted protocol-4 name. A control shows each payload is live under plain
``pickle``; the tests show that :mod:`rlcore.safe_pickle` refuses them,
naming the file and the global, and that the reference backend's resume
(a real ``Policy`` and worker) refuses them in its files. Also here: a static
scan of the sources for unrestricted loads, and the CUDA IPC handle format
(handles cross a socket as JSON, not pickles).
"""

from __future__ import annotations

import ast
import io
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from rlcore import safe_pickle
from rlcore.safe_pickle import UnsafeCheckpointError
from rlcore.testing.payloads import (
    dotted_payload,
    getattr_payload,
    system_payload,
    torch_save_payload,
)

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- payloads


PICKLE_PAYLOADS = {
    "os.system": (system_payload, "os.system"),
    "getattr-chain": (getattr_payload, "builtins.getattr"),
    "protocol-4-dotted": (dotted_payload, "torch.distributed.checkpoint.filesystem.os.system"),
}


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "payload-ran"


@pytest.mark.parametrize("build", [system_payload, getattr_payload, dotted_payload])
def test_control_each_payload_runs_under_plain_pickle(build, marker: Path) -> None:
    """Without the allow-list every payload runs (the tests below would be vacuous otherwise)."""
    pickle.loads(build(marker))  # noqa: S301 - the point of the control
    assert marker.exists()


@pytest.mark.parametrize("name", sorted(PICKLE_PAYLOADS))
def test_restricted_unpickler_refuses_and_names_the_file_and_global(name: str, marker: Path) -> None:
    build, refused = PICKLE_PAYLOADS[name]
    with pytest.raises(UnsafeCheckpointError) as err:
        safe_pickle.load_dcp_metadata(build(marker), "optimizer/.metadata")
    assert str(err.value) == f"optimizer/.metadata: refusing to load {refused} (not an allowed checkpoint type)"
    assert not marker.exists()


def test_restricted_unpickler_refuses_persistent_ids() -> None:
    buf = io.BytesIO()
    torch.save(torch.zeros(2), buf)  # data.pkl of a torch.save file refers to storages by persistent id
    with zipfile.ZipFile(buf) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    allowed = {("torch._utils", "_rebuild_tensor_v2"): object, ("torch", "FloatStorage"): object}
    with pytest.raises(UnsafeCheckpointError, match="x.pkl: refusing a persistent reference"):
        safe_pickle.restricted_loads(data, allowed, "x.pkl")


def test_dcp_allow_list_is_exact_data_types_only() -> None:
    """No module, no function but the layout lookup, no ``getattr``: classes, enums, dtypes by exact name."""
    import types

    for (module, name), obj in safe_pickle.dcp_metadata_globals().items():
        assert "." not in name, (module, name)
        assert not isinstance(obj, types.ModuleType), (module, name)
        assert isinstance(obj, (type, torch.dtype)) or obj is safe_pickle._layout, (module, name, obj)
    with pytest.raises(UnsafeCheckpointError, match="layout"):
        safe_pickle._layout("torch.__class__")


def test_genuine_dcp_metadata_loads_as_torch_reads_it(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)  # checkpoint_id: a Path
    raw = (tmp_path / ".metadata").read_bytes()
    got = safe_pickle.load_dcp_metadata(raw, ".metadata")
    assert got == pickle.loads(raw)  # noqa: S301 - our own file, the reference result
    loaded = {"a": torch.zeros(2, 3), "b": torch.zeros(2, dtype=torch.bfloat16)}

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return safe_pickle.read_dcp_metadata(self, kwargs.get("rank"))

    dcp.load(loaded, storage_reader=Reader(tmp_path), no_dist=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_dcp_metadata_may_not_point_outside_the_checkpoint(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"a": torch.zeros(2)}, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    metadata = pickle.loads((tmp_path / ".metadata").read_bytes())  # noqa: S301 - our own file
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    with pytest.raises(UnsafeCheckpointError, match=r"ckpt/\.metadata: the data of 'a' is not in a file"):
        safe_pickle.load_dcp_metadata(pickle.dumps(metadata), "ckpt/.metadata")


# --------------------------------------------------------------------------- torch.save files


@pytest.mark.parametrize("wrap", [lambda evil: evil, lambda evil: {"optimizer": {"state": {}, "x": evil}}])
def test_torch_load_refuses_code_and_names_the_file(wrap: Any, marker: Path, tmp_path: Path) -> None:
    path = tmp_path / "extra_state.pt"
    path.write_bytes(torch_save_payload(marker, wrap))
    with pytest.raises(UnsafeCheckpointError) as err:
        safe_pickle.torch_load(path, str(path))
    assert str(err.value) == f"{path}: refusing to load posix.system (not an allowed checkpoint type)"
    assert not marker.exists()


def test_resume_check_reads_the_pickled_files_on_the_driver(marker: Path, tmp_path: Path) -> None:
    """``rlcore run --resume``'s driver-side check: each pickled file of a step through the workers' readers,
    one line per file in rlcore's words (never torch's advice), nothing run, genuine files passed."""
    from rlcore.run.checkpoints import state_file_problems

    step = tmp_path / "step_000009"
    (step / "optimizer").mkdir(parents=True)
    (step / "optimizer" / ".metadata").write_bytes(system_payload(marker))
    (step / "extra_state.pt").write_bytes(torch_save_payload(marker, lambda evil: {"rng": evil}))
    (step / "damaged.pt").write_bytes(b"PK\x03\x04 not really a zip")
    torch.save({"step": torch.tensor(9), "rng": torch.get_rng_state()}, step / "genuine.pt")
    see = "(checkpoints are data, never code; see docs/writing-a-training-backend.md)"
    problems = state_file_problems(step)
    assert problems[0].startswith("damaged.pt: damaged, cannot be read ("), problems
    assert problems[1:] == [
        f"extra_state.pt: refusing to load posix.system (not an allowed checkpoint type) {see}",
        f"optimizer/.metadata: refusing to load os.system (not an allowed checkpoint type) {see}",
    ]
    assert not any("weights_only" in line for line in problems)
    assert not marker.exists()
    for path in (step / "optimizer" / ".metadata", step / "extra_state.pt", step / "damaged.pt"):
        path.unlink()
    assert state_file_problems(step) == []


def test_resume_check_finds_a_shard_cut_short_or_missing(tmp_path: Path) -> None:
    """The DCP shards are checked against the byte ranges ``.metadata`` places in them (a genuine save passes;
    the expected end is recomputed here from the tensors' sizes, not read back from the index)."""
    import torch.distributed.checkpoint as dcp

    from rlcore.run.checkpoints import state_file_problems

    step = tmp_path / "step_000003"
    state = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(5, dtype=torch.bfloat16)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(step / "optimizer"), no_dist=True)
    assert state_file_problems(step) == []
    (shard,) = (step / "optimizer").glob("*.distcp")
    data = shard.read_bytes()
    assert len(data) >= 6 * 4 + 5 * 2  # both tensors' bytes are in the one shard
    shard.write_bytes(data[:10])
    (problem,) = state_file_problems(step)
    assert problem.startswith(
        f"optimizer/{shard.name}: damaged, 10 bytes where optimizer/.metadata places data up to byte "
    ), problem
    assert int(problem.split("up to byte ")[1].split()[0]) > 10
    shard.unlink()
    assert state_file_problems(step) == [
        f"optimizer/{shard.name}: missing, though optimizer/.metadata places data in it"
    ]


def test_resume_check_finds_a_shard_replaced_by_another_file_of_the_same_size(tmp_path: Path) -> None:
    """A ``.distcp`` replaced by a same-size pickle was read only by the workers, after Ray started ("Unsupported
    operand 0"); every item DCP places in a shard starts as a ``torch.save`` archive, which the driver checks."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from rlcore.run.checkpoints import state_file_problems

    step = tmp_path / "step_000003"
    state = {"a": torch.arange(6.0).reshape(2, 3), "opt": {"step": 3, "lr": 0.1}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(step / "optimizer"), no_dist=True)
    (shard,) = (step / "optimizer").glob("*.distcp")
    size = shard.stat().st_size
    payload = pickle.dumps({"a": list(range(6))}, protocol=2)
    shard.write_bytes(payload + b"\0" * (size - len(payload)))
    assert state_file_problems(step) == [
        f"optimizer/{shard.name}: damaged, the item optimizer/.metadata places at byte 0 is not a torch.save "
        "archive (replaced by another file)"
    ]


def test_torch_load_sets_aside_globals_other_libraries_registered(tmp_path: Path) -> None:
    """megatron-core registers e.g. ``argparse.Namespace`` process-wide; a checkpoint gets torch's list only."""
    import argparse

    path = tmp_path / "state.pt"
    torch.save({"args": argparse.Namespace(lr=1.0)}, path)
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([argparse.Namespace])
    try:
        assert torch.load(path, weights_only=True)["args"].lr == 1.0  # the process-wide list admits it
        with pytest.raises(UnsafeCheckpointError, match="refusing to load argparse.Namespace"):
            safe_pickle.torch_load(path, str(path))
        assert safe_pickle.torch_load(path, str(path), allowed=[argparse.Namespace])["args"].lr == 1.0
        assert argparse.Namespace in torch.serialization.get_safe_globals()  # put back afterwards
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def test_hf_pickle_weights_are_read_weights_only(tmp_path: Path, tiny_model_dir: str, marker: Path) -> None:
    """A resume's ``weights/`` goes to ``from_pretrained``, which also reads ``pytorch_model.bin``."""
    from transformers import AutoModelForCausalLM

    weights = tmp_path / "weights"
    weights.mkdir()
    shutil.copy(Path(tiny_model_dir) / "config.json", weights)
    (weights / "pytorch_model.bin").write_bytes(torch_save_payload(marker, lambda evil: {"lm_head.weight": evil}))
    with pytest.raises(Exception, match="posix.system"):
        AutoModelForCausalLM.from_pretrained(str(weights))
    assert not marker.exists()


# --------------------------------------------------------------------------- the reference backend's resume


def _config(model: str) -> Any:
    from rlcore.config import load_config_dict

    policy = {
        "backend": "reference",
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


def _batch(tokenizer: Any, seed: int) -> Any:
    from rlcore.data import BatchedDataDict
    from rlcore.testing.models import make_batch

    return BatchedDataDict(make_batch(tokenizer, 2, 5, 12, seed=seed))


def _losses(policy: Any, batches: list) -> list[float]:
    from rlcore.algorithms.loss_functions import NLLLoss

    return [float(policy.train(b, NLLLoss())["loss"][0]) for b in batches]


def _load(policy: Any, weights: Path, optimizer: Path) -> None:
    group = policy.worker_group
    group.get_results(group.run_all_workers_single_data("load_checkpoint", str(weights), str(optimizer)))


@pytest.fixture(scope="module")
def reference(ray_session: None, tiny_model_dir: str, tiny_tokenizer: Any, tmp_path_factory: Any) -> Any:
    """A trained reference policy, its checkpoint after step 1 and the uninterrupted losses of steps 2 and 3.

    Its workers survive exceptions (``kill_on_error`` off), so one policy loads every forged checkpoint.
    """
    from rlcore.policy import Policy
    from rlcore.testing.pytest_plugin import ClusterPool

    root = tmp_path_factory.mktemp("untrusted-reference")
    batches = [_batch(tiny_tokenizer, seed) for seed in (1, 2, 3)]
    clusters = ClusterPool()
    policy = Policy(
        clusters(1), _config(tiny_model_dir), tiny_tokenizer, name_prefix="untrusted-ref", init_reference_model=False
    )
    try:
        _losses(policy, batches[:1])
        policy.save_checkpoint(str(root / "weights"), str(root / "optimizer.pt"))
        later = _losses(policy, batches[1:])
        policy.worker_group.kill_on_error = False
        yield {
            "policy": policy,
            "root": root,
            "batches": batches,
            "later": later,
            "clusters": clusters,
            "config": _config(tiny_model_dir),
            "tokenizer": tiny_tokenizer,
        }
    finally:
        policy.shutdown()
        clusters.shutdown()


REFERENCE_OPTIMIZER_PAYLOADS = {
    "torch.save-os.system": (
        lambda m: torch_save_payload(m, lambda e: {"optimizer": e, "scheduler": None}),
        "posix.system",
    ),
    "legacy-pickle-os.system": (system_payload, "os.system"),
    "legacy-pickle-getattr": (getattr_payload, "getattr"),  # torch names builtins without the module
}


@pytest.mark.parametrize("name", sorted(REFERENCE_OPTIMIZER_PAYLOADS))
def test_reference_load_refuses_forged_optimizer_state(reference: dict, name: str, tmp_path: Path) -> None:
    build, refused = REFERENCE_OPTIMIZER_PAYLOADS[name]
    marker = tmp_path / "payload-ran"
    forged = tmp_path / "optimizer.pt"
    forged.write_bytes(build(marker))
    with pytest.raises(Exception) as err:
        _load(reference["policy"], reference["root"] / "weights", forged)
    assert f"{forged}: refusing to load" in str(err.value) and refused in str(err.value), str(err.value)
    assert not marker.exists()


def test_reference_resume_refuses_forged_optimizer_state(reference: dict, tmp_path: Path) -> None:
    """The ``--resume`` path itself: a new ``Policy`` given the checkpoint's paths fails to start."""
    from rlcore.policy import Policy

    marker = tmp_path / "payload-ran"
    forged = tmp_path / "optimizer.pt"
    forged.write_bytes(torch_save_payload(marker, lambda e: {"optimizer": e, "scheduler": None}))
    with pytest.raises(Exception) as err:
        Policy(
            reference["clusters"](1),
            reference["config"],
            reference["tokenizer"],
            name_prefix="untrusted-resume",
            weights_path=str(reference["root"] / "weights"),
            optimizer_path=str(forged),
            init_reference_model=False,
        )
    assert f"{forged}: refusing to load posix.system" in str(err.value), str(err.value)
    assert not marker.exists()


def test_reference_genuine_checkpoint_still_resumes(reference: dict) -> None:
    """Weights and AdamW state come back: steps 2 and 3 repeat exactly (step 3 depends on the moments)."""
    _load(reference["policy"], reference["root"] / "weights", reference["root"] / "optimizer.pt")
    assert _losses(reference["policy"], reference["batches"][1:]) == reference["later"]


# --------------------------------------------------------------------------- no unrestricted load in the sources

_PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve"}
_SAFE_PICKLE = ROOT / "src" / "rlcore" / "safe_pickle.py"


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unrestricted_loads(path: Path, root: Path = ROOT) -> list[str]:
    """``path:line: what`` for every call or class that could unpickle without restriction."""
    found = []
    trusted = path == _SAFE_PICKLE
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.module in _PICKLE_MODULES | {"torch"}:
            names = {a.name for a in node.names} & {"load", "loads", "Unpickler", "open"}
            if names and not (trusted and names == {"Unpickler"}):
                found.append(f"{where}: from {node.module} import {', '.join(sorted(names))}")
        elif isinstance(node, ast.ClassDef):
            for base in map(_dotted, node.bases):
                if base.endswith("Unpickler") and not trusted:
                    found.append(f"{where}: class {node.name}({base}) (use rlcore.safe_pickle)")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            module, _, attr = name.rpartition(".")
            keywords = {k.arg: k.value for k in node.keywords}
            if (
                module.split(".")[-1] in _PICKLE_MODULES
                and attr in {"load", "loads", "Unpickler", "open"}
                and not (trusted and attr == "Unpickler")
            ):
                found.append(f"{where}: {name}(...)")
            elif name.endswith("torch.load") and not _is_true(keywords.get("weights_only")):
                found.append(f"{where}: {name}(...) without weights_only=True")
            elif isinstance(keywords.get("weights_only"), ast.Constant) and keywords["weights_only"].value is False:
                found.append(f"{where}: weights_only=False")
            elif _is_true(keywords.get("allow_pickle")):
                found.append(f"{where}: allow_pickle=True")
            elif attr == "add_safe_globals" and not trusted:
                found.append(f"{where}: {name}(...) widens every weights_only load in the process")
    return found


def _sources() -> list[Path]:
    roots = [ROOT / "src", *sorted((ROOT / "plugins").glob("*/src"))]
    return sorted(p for root in roots for p in root.rglob("*.py"))


def test_scanner_finds_each_kind_of_unrestricted_load(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import pickle, torch\nfrom pickle import loads\n"
        "pickle.load(f)\npickle.loads(b)\ntorch.load(p)\ntorch.load(p, weights_only=False)\n"
        "x = foo(weights_only=False)\nclass U(pickle.Unpickler): pass\nnumpy.load(p, allow_pickle=True)\n"
        "torch.serialization.add_safe_globals([X])\ntorch.load(p, weights_only=True)\n"
    )
    found = unrestricted_loads(sample, root=tmp_path)
    assert sorted(int(line.split(":")[1]) for line in found) == list(range(2, 11)), found


def test_no_unrestricted_unpickling_in_the_sources() -> None:
    sources = _sources()
    assert _SAFE_PICKLE in sources and len(sources) > 50
    found = [line for path in sources for line in unrestricted_loads(path)]
    assert not found, "unrestricted unpickling (design.md §2.8):\n" + "\n".join(found)


# --------------------------------------------------------------------------- CUDA IPC handles are data


def _fake_ipc_args() -> tuple:
    """What ``reduce_tensor`` gives for a CUDA tensor: ``rebuild_cuda_tensor``'s 15 arguments."""
    return (
        torch.nn.Parameter,
        torch.Size([4, 3]),
        (3, 1),
        2,
        torch.storage.TypedStorage,
        torch.bfloat16,
        1,
        b"\x01ipc-handle\x00\xff",
        4096,
        512,
        True,
        b"/torch_1234_ref",
        7,
        b"\x02event\x00",
        False,
    )


#: The wire form of :func:`_fake_ipc_args`.
FAKE_HANDLE = {
    "cuda_ipc": 1,
    "tensor_cls": "torch.nn.parameter.Parameter",
    "tensor_size": [4, 3],
    "tensor_stride": [3, 1],
    "tensor_offset": 2,
    "storage_cls": "torch.storage.TypedStorage",
    "dtype": "bfloat16",
    "storage_device": 1,
    "storage_handle": "AWlwYy1oYW5kbGUA/w==",
    "storage_size_bytes": 4096,
    "storage_offset_bytes": 512,
    "requires_grad": True,
    "ref_counter_handle": "L3RvcmNoXzEyMzRfcmVm",
    "ref_counter_offset": 7,
    "event_handle": "AmV2ZW50AA==",
    "event_sync_required": False,
}


def test_cuda_ipc_handle_round_trips_rebuild_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wire format alone (no GPU here): ``reduce_tensor`` and ``rebuild_cuda_tensor`` are recording fakes."""
    from torch.multiprocessing import reductions

    from rlcore.refit.cuda_ipc import encode_handle, open_handle

    calls: list = []

    def rebuild(*args: Any) -> str:
        calls.append(args)
        return "rebuilt"

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    monkeypatch.setattr(reductions, "reduce_tensor", lambda tensor: (rebuild, _fake_ipc_args()))
    handle = encode_handle(object())
    assert json.loads(handle) == FAKE_HANDLE
    assert open_handle(handle) == "rebuilt"
    assert calls == [_fake_ipc_args()]
    assert [type(a) for a in calls[0]] == [type(a) for a in _fake_ipc_args()]


@pytest.mark.parametrize("tensor", [torch.zeros(2), torch.zeros(2, device="meta"), torch.zeros(2).to_sparse()])
def test_cuda_ipc_handle_only_for_cuda_tensors(tensor: torch.Tensor) -> None:
    from rlcore.refit.cuda_ipc import encode_handle

    with pytest.raises(ValueError, match="only dense CUDA tensors"):
        encode_handle(tensor)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("tensor_cls", "os.system", "tensor_cls 'os.system' is not one of"),
        ("tensor_cls", "builtins.getattr", "is not one of"),
        ("storage_cls", "torch.Tensor", "storage_cls 'torch.Tensor' is not one of"),
        ("storage_cls", "torch.storage.TypedStorage._new_shared_cuda", "is not one of"),
        ("dtype", "__class__", "unknown dtype"),
        ("dtype", {"py/object": "os.system"}, "unknown dtype"),
        ("storage_handle", 5, "base64"),
        ("storage_handle", "not base64!", "base64"),
        ("tensor_size", [1, "2"], "non-negative integers"),
        ("tensor_stride", [-1], "non-negative integers"),
        ("requires_grad", 1, "true or false"),
        ("storage_device", True, "non-negative integer"),
    ],
)
def test_cuda_ipc_handle_cannot_name_other_classes_or_functions(field: str, value: Any, message: str) -> None:
    from rlcore.refit.cuda_ipc import decode_handle, open_handle

    assert decode_handle(json.dumps(FAKE_HANDLE)) == _fake_ipc_args()
    forged = json.dumps({**FAKE_HANDLE, field: value})
    for read in (decode_handle, open_handle):  # open_handle decodes before torch sees anything
        with pytest.raises(ValueError, match=message):
            read(forged)


@pytest.mark.parametrize(
    "handle",
    [
        "not json",
        "[]",
        '{"cuda_ipc": 1}',
        json.dumps({**FAKE_HANDLE, "cuda_ipc": 2}),
        json.dumps({**FAKE_HANDLE, "__reduce__": "os.system"}),
        pickle.dumps(os.system).hex(),
    ],
)
def test_cuda_ipc_handle_must_be_the_exact_json_object(handle: str) -> None:
    from rlcore.refit.cuda_ipc import open_handle

    with pytest.raises(ValueError, match="CUDA IPC handle"):
        open_handle(handle)


_IPC_CHILD = r"""
import sys, torch
from rlcore.refit.cuda_ipc import open_handle
t = open_handle(sys.stdin.readline().strip())
print(float(t.sum()), t.dtype, t.shape, flush=True)
t.mul_(2)
torch.cuda.synchronize()
"""


@pytest.mark.gpu
def test_cuda_ipc_handle_opens_in_another_process() -> None:
    import subprocess
    import sys

    from rlcore.refit.cuda_ipc import encode_handle

    tensor = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)[1:]  # a view: offset, shape
    child = subprocess.run(
        [sys.executable, "-c", _IPC_CHILD],
        input=encode_handle(tensor) + "\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split()[:1] == [str(float(torch.arange(4, 12).sum()))]
    torch.cuda.synchronize()
    assert torch.equal(tensor.cpu(), torch.arange(4, 12, dtype=torch.float32).reshape(2, 4) * 2)
