"""Step checkpoints of a run: ``<dir>/step_NNNNNN/{weights,optimizer,tokenizer,state.json}``, and
``rollouts/`` when a run generates ahead of training (:func:`save_rollouts`).

Each step directory is published atomically (built aside, then renamed), so
a crash mid-save leaves the previous step checkpoint whole, and ``--resume``
only ever sees complete ones. A save that fills the disk stops the run in one
line saying so, and which checkpoint is whole (:class:`DiskFull`).
"""

from __future__ import annotations

import errno
import json
import re
import shutil
from pathlib import Path
from typing import Any

from rlcore.run.errors import RunError, error_chain
from rlcore.training.checkpoint import atomic_directory, copy_processor_files, recover_checkpoint

#: What a full disk (or quota) says, by errno: the words of ``strerror``, which wrapped errors quote.
_FULL_DISK = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded"}
#: What torch's zip writer says when a write stops short, as writes do on a full disk (it drops the errno).
_SHORT_WRITE = re.compile(r"unexpected pos \d+ vs \d+")


class DiskFull(RunError):
    """A step checkpoint could not be saved for want of space; the message says which checkpoint is whole."""


class DamagedCheckpoint(RunError):
    """A step checkpoint's ``state.json`` cannot be read, or holds no step number; the message names the file."""


def checkpoint_root(cfg: Any) -> Path:
    """Where a run's step checkpoints go: ``<logger.output_dir>/checkpoints``."""
    return Path(cfg.logger.output_dir) / "checkpoints"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def save_step(
    policy: Any,
    root: str | Path,
    step: int,
    keep_last: int,
    extra: dict[str, Any] | None = None,
    metric: tuple[str, bool] | None = None,
    rollouts: dict[int, Any] | None = None,
    value_model: Any = None,
) -> Path:
    """Save step ``step`` (``extra`` joins its ``state.json``; ``rollouts``, generated ahead from weights older
    than the saved ones, go to ``rollouts/``: :func:`save_rollouts`; a ``value_model``, a run's critic, to
    ``value/weights`` and ``value/optimizer``) and drop the checkpoints :func:`kept` leaves out. A full disk
    raises :class:`DiskFull` (the partial save removed, the previous checkpoint whole)."""
    final = step_dir(root, step)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        with atomic_directory(final) as tmp:
            policy.save_checkpoint(str(tmp / "weights"), str(tmp / "optimizer"), str(tmp / "tokenizer"))
            if (tmp / "weights").is_dir():  # a vision-language model's weights load with its processor (vLLM's)
                copy_processor_files(tmp / "tokenizer", tmp / "weights")
            if value_model is not None:
                value_model.save_checkpoint(str(tmp / VALUE_MODEL / "weights"), str(tmp / VALUE_MODEL / "optimizer"))
            if rollouts:
                save_rollouts(tmp / ROLLOUTS, rollouts)
            (tmp / "state.json").write_text(json.dumps({"step": step, **(extra or {})}))
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        if (full := disk_full(exc)) is None:
            raise
        raise DiskFull(f"{full} while saving step {step} to {root}; {whole_checkpoint(root)}") from exc
    steps = sorted(Path(root).glob("step_*"))
    keep = kept([(d, read_state(d)) for d in steps if (d / "state.json").is_file()], keep_last, metric)
    for old in steps:
        if old not in keep:
            shutil.rmtree(old, ignore_errors=True)
    return final


#: The directory of a step checkpoint holding the rollouts generated ahead (:func:`save_rollouts`).
ROLLOUTS = "rollouts"
#: The directory of a step checkpoint holding the critic's ``weights/`` and ``optimizer/`` (a run's value model).
VALUE_MODEL = "value"


def save_rollouts(directory: Path, rollouts: dict[int, Any]) -> None:
    """``{training step: Rollout}`` as ``step_NNNNNN.safetensors`` files: the rollout's tensors (``data/<key>``
    and ``rewards``) with its metrics as JSON in the file's metadata. Data, never pickles: a checkpoint is
    untrusted input (design.md §2.8). Every value of ``data`` is a tensor, or a list of one tensor per row (a
    vision-language run's ``pixel_values``): :func:`_row_tensors`."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    for step, rollout in sorted(rollouts.items()):
        tensors = {}
        for key, value in rollout.data.items():
            if isinstance(value, list):
                tensors.update(_row_tensors(key, value))
            else:
                tensors[f"data/{key}"] = value.contiguous()
        tensors["rewards"] = rollout.rewards.contiguous()
        save_file(tensors, str(directory / f"step_{step:06d}.safetensors"), {"metrics": json.dumps(rollout.metrics)})


def _row_tensors(key: str, rows: list[Any]) -> dict[str, Any]:
    """A per-row list of tensors as safetensors entries: each distinct tensor once (``rows/<key>/<i>``; a
    prompt's copies share their pixels) and which one each row holds (``rows/<key>/index``)."""
    import torch

    first_of: dict[int, int] = {}
    out: dict[str, Any] = {}
    for tensor in rows:
        if id(tensor) not in first_of:
            first_of[id(tensor)] = len(first_of)
            out[f"rows/{key}/{first_of[id(tensor)]}"] = tensor.contiguous()
    out[f"rows/{key}/index"] = torch.tensor([first_of[id(t)] for t in rows], dtype=torch.long)
    return out


def load_rollouts(checkpoint: str | Path) -> dict[int, Any]:
    """The rollouts a step checkpoint carries (:func:`save_rollouts`), by the training step they are for; empty
    when it carries none."""
    from safetensors import safe_open

    from rlcore.data import BatchedDataDict
    from rlcore.run.rollouts import Rollout
    from rlcore.training.checkpoint_files import check_inside

    directory = Path(checkpoint) / ROLLOUTS
    found: dict[int, Any] = {}
    if not directory.is_dir():
        return found
    check_inside(directory)
    for path in sorted(directory.glob("step_*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            data: dict[str, Any] = {
                key.removeprefix("data/"): f.get_tensor(key) for key in f.keys() if key.startswith("data/")
            }
            for key in (k for k in f.keys() if k.startswith("rows/") and k.endswith("/index")):
                name = key.removeprefix("rows/").removesuffix("/index")
                distinct = [f.get_tensor(f"rows/{name}/{i}") for i in range(int(f.get_tensor(key).max()) + 1)]
                data[name] = [distinct[int(i)] for i in f.get_tensor(key)]
            metrics = json.loads((f.metadata() or {}).get("metrics", "{}"))
            found[int(path.stem.removeprefix("step_"))] = Rollout(
                BatchedDataDict(data), f.get_tensor("rewards"), metrics
            )
    return found


def disk_full(exc: BaseException) -> str | None:
    """``'No space left on device'`` (or ``'Disk quota exceeded'``) when ``exc`` or an error behind it says so:
    an ``OSError``'s errno, or its words in a wrapping error's text (torch's ``CheckpointException`` lists each
    rank's error; a worker's error reaches the driver as text); None otherwise."""
    for error in error_chain(exc):
        if isinstance(error, OSError) and error.errno in _FULL_DISK:
            return _FULL_DISK[error.errno]
        text = str(error)
        if found := next((words for words in _FULL_DISK.values() if words in text), None):
            return found
        if short := _SHORT_WRITE.search(text):
            return f"No space left on device (torch's checkpoint writer stopped short: {short.group(0)})"
    return None


def full_disk_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` (ENOSPC or EDQUOT) in ``exc``'s chain, when a full disk stopped a write in this process."""
    return next((e for e in error_chain(exc) if isinstance(e, OSError) and e.errno in _FULL_DISK), None)


def whole_checkpoint(root: str | Path) -> str:
    """What a failed save leaves to resume from, and what to do (the end of :class:`DiskFull`'s line)."""
    try:
        latest = latest_step(root)
    except OSError:
        latest = None
    if latest is None:
        return "no earlier step checkpoint was saved; free some space and run again"
    return (
        f"the checkpoint of step {latest[0]} is whole ({latest[1]}); free some space and resume from it with --resume"
    )


def complete_steps(root: str | Path) -> list[int]:
    """The steps of the complete step checkpoints in ``root``, oldest first (after :func:`latest_step`'s repair)."""
    found = [read_state(d)["step"] for d in Path(root).glob("step_*") if (d / "state.json").is_file()]
    return sorted(found)


def kept(
    checkpoints: list[tuple[Path, dict[str, Any]]], keep_last: int, metric: tuple[str, bool] | None = None
) -> set[Path]:
    """The checkpoints to keep: the ``keep_last`` newest; with ``metric`` = ``(name, higher_is_better)`` the
    ``keep_last`` best by ``state["metrics"][name]`` (ties: the newer; a checkpoint without it is the worst),
    and the newest in any case, to resume from."""
    by_step = sorted(checkpoints, key=lambda c: c[1]["step"], reverse=True)
    if metric is None:
        return {d for d, _ in by_step[:keep_last]}
    name, higher = metric
    worst = float("-inf") if higher else float("inf")

    def value(state: dict[str, Any]) -> float:
        return state.get("metrics", {}).get(name, worst)

    ranked = sorted(by_step, key=lambda c: (value(c[1]) if higher else -value(c[1]), c[1]["step"]), reverse=True)
    return {d for d, _ in ranked[:keep_last]} | {d for d, _ in by_step[:1]}


def read_state(directory: str | Path) -> dict[str, Any]:
    """A step checkpoint's ``state.json`` (its step, and the data position since rlcore 0.2); one that cannot
    be read, or holds no step number, raises :class:`DamagedCheckpoint` naming it."""
    path = Path(directory) / "state.json"
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        detail = next(iter((getattr(exc, "strerror", None) or str(exc)).splitlines()), "no detail")[:120]
        raise DamagedCheckpoint(_damaged(path, f"cannot be read ({type(exc).__name__}: {detail})")) from None
    step = state.get("step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise DamagedCheckpoint(_damaged(path, 'holds no step number (a JSON object with "step": N is expected)'))
    named = _directory_step(path.parent)
    if named is not None and named != step:
        raise DamagedCheckpoint(
            _damaged(path, f"holds step {step}, but its directory is {path.parent.name} (step {named})")
        )
    return state


def _directory_step(directory: Path) -> int | None:
    """The step a ``step_NNNNNN`` directory's name says (None for another name, e.g. a link's target)."""
    digits = directory.name.removeprefix("step_")
    return int(digits) if directory.name.startswith("step_") and digits.isdigit() else None


def _damaged(path: Path, why: str) -> str:
    return (
        f"{path}: damaged, {why}; move {path.parent.name} away to resume from the step before it, or start "
        "fresh in another logger.output_dir"
    )


def resume_problems(policy: Any, step_dir: Path, value_model: Any = None) -> list[str]:
    """What would stop a resume from ``step_dir``, one line each, found on the driver before Ray starts:
    files reaching outside the step directory (``weights/`` a link out of it too; only the step directory itself
    may be a link), missing or damaged weights (:func:`rlcore.preflight.check_policy_sources`; the critic's under
    ``value/`` too when the run has a ``value_model``, its policy config),
    state files that name code, cannot be read or are cut short (:func:`state_file_problems`)."""
    from rlcore.preflight import check_policy_sources
    from rlcore.training.checkpoint_files import outside_files

    field = f"--resume from {step_dir}"
    # The step directory itself may be a link (latest -> step_40); nothing in it may reach out, weights/ included.
    lines = [f"{field}: {line}" for line in outside_files(step_dir)]
    lines = lines or check_policy_sources(policy, step_dir / "weights", step_dir / "optimizer", fields=(field, field))
    if value_model is not None and not lines:
        critic = step_dir / VALUE_MODEL
        lines = check_policy_sources(value_model, critic / "weights", critic / "optimizer", fields=(field, field))
    lines = lines or [f"{field}: {line}" for line in state_file_problems(step_dir)]
    return [f"{line} (or move {step_dir.name} away to resume from the step before it)" for line in lines]


#: Suffixes of files torch saves in its legacy (non-zip) pickle format.
_PICKLED_SUFFIXES = (".pt", ".pth", ".bin")
#: Files read otherwise: weights by their header checks, DCP shards by byte ranges the ``.metadata`` names.
_NOT_PICKLES = (".safetensors", ".distcp", ".json")


def state_file_problems(step_dir: Path) -> list[str]:
    """The checkpoint's pickled files, read on the driver with the readers the workers use (nothing in them
    runs): DCP ``.metadata`` with its exact allow-list (and its shards' extents, :func:`shard_problems`),
    ``torch.save`` files (zip, or ``*.pt``/``.pth``/``.bin``) with torch's weights-only one (tensors mapped, not
    read). One line per file that names code or is damaged, in rlcore's words."""
    import zipfile

    from rlcore.safe_pickle import UnsafeCheckpointError, load_dcp_metadata, torch_load

    problems = []
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file() and p.suffix not in _NOT_PICKLES):
        name = str(path.relative_to(step_dir))
        is_zip = zipfile.is_zipfile(path)  # torch.save's format, whatever the file is called
        try:
            if path.name == ".metadata":
                problems += shard_problems(load_dcp_metadata(path.read_bytes(), name), path.parent, step_dir)
            elif is_zip or path.suffix in _PICKLED_SUFFIXES:
                torch_load(str(path), name, mmap=is_zip)
        except UnsafeCheckpointError as exc:
            problems.append(f"{exc} (checkpoints are data, never code; see docs/writing-a-training-backend.md)")
        except Exception as exc:  # noqa: BLE001 - whatever a damaged file raises, it is one line
            detail = (str(exc).splitlines() or ["no detail"])[0][:120]
            problems.append(f"{name}: damaged, cannot be read ({type(exc).__name__}: {detail})")
    return problems


def shard_problems(metadata: Any, directory: Path, step_dir: Path) -> list[str]:
    """The DCP shard files ``metadata`` places data in: each must exist and hold every byte range it names
    (a truncated or replaced ``.distcp`` is found here, not as an ``EOFError`` inside a worker)."""
    needed: dict[str, int] = {}
    offsets: dict[str, set[int]] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        offsets.setdefault(info.relative_path, set()).add(info.offset)
    problems = []
    for file, end in sorted(needed.items()):
        path = directory / file
        name = str(path.relative_to(step_dir))
        size = path.stat().st_size if path.is_file() else None
        if size is None:
            problems.append(f"{name}: missing, though {path.parent.name}/.metadata places data in it")
        elif size < end:
            problems.append(
                f"{name}: damaged, {size} bytes where {path.parent.name}/.metadata places data up to "
                f"byte {end} (truncated or replaced)"
            )
        elif (offset := _foreign_item(path, offsets[file])) is not None:
            problems.append(
                f"{name}: damaged, the item {path.parent.name}/.metadata places at byte {offset} is not a "
                "torch.save archive (replaced by another file)"
            )
    return problems


#: The first bytes of every item torch's DCP file writer stores: a ``torch.save`` zip archive (tensors and
#: pickled objects alike).
_ZIP_MAGIC = b"PK\x03\x04"


def _foreign_item(path: Path, offsets: set[int]) -> int | None:
    """The first offset in ``path`` where the item DCP's metadata places there does not start as a
    ``torch.save`` archive does, or None (a few bytes read per item; the workers read the rest)."""
    with open(path, "rb") as f:
        for offset in sorted(offsets):
            f.seek(offset)
            if f.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
                return offset
    return None


def latest_step(root: str | Path) -> tuple[int, Path] | None:
    """``(step, directory)`` of the newest complete step checkpoint, or None.

    Repairs what a crash mid-save left: a swap interrupted between its renames is undone, and the
    temporary directories of saves that never completed are removed (one run writes ``root``).
    """
    root = Path(root)
    if not root.is_dir():
        return None
    for partial in root.glob(".step_*.tmp-*"):
        shutil.rmtree(partial, ignore_errors=True)
    for candidate in sorted(root.glob("step_*"), reverse=True):
        recover_checkpoint(candidate)
        if (candidate / "state.json").is_file():
            return read_state(candidate)["step"], candidate
    return None
