"""Tiny local models/tokenizers, optimizer + scheduler building, grad clipping, atomic checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rlcore.models import cache as model_cache  # noqa: E402
from rlcore.testing import models as tm  # noqa: E402
from rlcore.training import checkpoint as ckpt  # noqa: E402
from rlcore.training.optim import build_optimizer, build_scheduler, clip_grad_norm_  # noqa: E402

TOKENIZER_VOCAB = 259  # 3 specials + 256 bytes


def tree_digest(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under root."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


@pytest.fixture(scope="module")
def tokenizer():
    return tm.build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tm.build_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


# --------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize(
    "text", ["Hello, world!", "  leading and trailing  ", "héllo wörld — 日本語 🎉\n\ttabs", "<s>x</s>", ""]
)
def test_tokenizer_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    if "<s>" not in text:
        assert len(ids) == len(text.encode("utf-8"))  # one token per byte, nothing added


def test_tokenizer_ids_and_save_load(tokenizer, tmp_path):
    assert len(tokenizer) == TOKENIZER_VOCAB
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.encode("A") == [ord("A") + tm.BYTE_OFFSET]
    assert tokenizer.encode("é") == [b + tm.BYTE_OFFSET for b in "é".encode()]

    tm.build_tiny_tokenizer(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "round trip ünïcode ✓"
    assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)

    chat = loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<s><|user|>\nhi</s>\n<|assistant|>\n"


# --------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", tm.ARCHS)
def test_build_tiny_model_loads(tmp_path, arch, tied):
    path = tm.build_tiny_model(tmp_path / "m", arch, tie_word_embeddings=tied)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    cfg = model.config
    assert cfg.model_type == arch
    assert cfg.head_dim >= 32 and cfg.vocab_size == 320 and cfg.num_key_value_heads == 1
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert os.path.exists(os.path.join(path, "model.safetensors"))
    on_disk = ckpt.load_hf_state_dict(path)
    assert ("lm_head.weight" in on_disk) == (not tied)
    for name, tensor in model.state_dict().items():
        if name in on_disk:
            assert torch.equal(tensor, on_disk[name]), name
    assert transformers.AutoTokenizer.from_pretrained(path).encode("ok") == [ord("o") + 3, ord("k") + 3]


def test_build_tiny_model_deterministic(tmp_path):
    torch.manual_seed(123)
    before = torch.rand(3)
    a = ckpt.load_hf_state_dict(tm.build_tiny_model(tmp_path / "a", "qwen2", seed=7))
    b = ckpt.load_hf_state_dict(tm.build_tiny_model(tmp_path / "b", "qwen2", seed=7))
    c = ckpt.load_hf_state_dict(tm.build_tiny_model(tmp_path / "c", "qwen2", seed=8))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    # the caller's global RNG stream is not disturbed
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), before)


def test_build_tiny_model_validates(tmp_path):
    with pytest.raises(ValueError, match="head_dim"):
        tm.build_tiny_model(tmp_path, head_dim=16)
    with pytest.raises(ValueError, match="arch"):
        tm.build_tiny_model(tmp_path, "gpt2")


def test_build_tiny_model_dtype(tmp_path):
    path = tm.build_tiny_model(tmp_path, "llama", dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in ckpt.load_hf_state_dict(path).values())


def test_tiny_model_path_caches(tmp_path, monkeypatch):
    first = tm.tiny_model_path(cache_root=tmp_path, arch="llama")
    # explicit defaults hash the same; no rebuild happens
    monkeypatch.setattr(model_cache, "build_tiny_model", lambda *a, **k: pytest.fail("rebuilt"))
    assert tm.tiny_model_path(cache_root=tmp_path, arch="llama", hidden_size=64, dtype=torch.float32) == first
    assert transformers.AutoModelForCausalLM.from_pretrained(first).config.model_type == "llama"
    assert [p.name for p in tmp_path.iterdir()] == [Path(first).name]


def test_tiny_model_path_lost_race(tmp_path, monkeypatch):
    """Another process publishes the same model while we build: we use theirs, drop ours."""
    real_build = tm.build_tiny_model
    name = Path(tm.tiny_model_path(cache_root=tmp_path / "ref", arch="qwen3")).name
    cache = tmp_path / "cache"

    def build_and_lose(save_dir, **kwargs):
        real_build(save_dir, **kwargs)
        real_build(cache / name, **kwargs)  # the "other process" renames first
        (cache / name / "winner").touch()
        return str(save_dir)

    monkeypatch.setattr(model_cache, "build_tiny_model", build_and_lose)
    got = Path(tm.tiny_model_path(cache_root=cache, arch="qwen3"))
    assert got == cache / name and (got / "winner").exists()
    assert siblings(got) == [name]  # our temp build was removed


# --------------------------------------------------------------------------- make_batch


@pytest.mark.parametrize("source", ["tokenizer", "vocab"])
def test_make_batch(tokenizer, source):
    arg = tokenizer if source == "tokenizer" else 50
    batch = tm.make_batch(arg, batch_size=6, min_len=3, max_len=12, seed=1)
    ids, lengths, tmask, smask = (batch[k] for k in ("input_ids", "input_lengths", "token_mask", "sample_mask"))
    assert ids.dtype == torch.int64 and lengths.dtype == torch.int64
    assert ids.shape == tmask.shape == (6, int(lengths.max()))
    assert smask.shape == (6,) and torch.equal(smask, torch.ones(6))
    assert ((lengths >= 3) & (lengths <= 12)).all()
    for row, n in enumerate(lengths.tolist()):
        assert (ids[row, n:] == 0).all() and (tmask[row, n:] == 0).all()
        mask = tmask[row, :n]
        assert mask[0] == 0 and mask[-1] == 1  # at least one prompt and one response token
        assert (mask[1:] >= mask[:-1]).all()  # prompt then response, contiguous
        valid = ids[row, :n]
        if source == "tokenizer":
            assert (valid >= tm.BYTE_OFFSET).all() and (valid < TOKENIZER_VOCAB).all()
        else:
            assert (valid < 50).all()
    again = tm.make_batch(arg, batch_size=6, min_len=3, max_len=12, seed=1)
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    other = tm.make_batch(arg, batch_size=6, min_len=3, max_len=12, seed=2)
    assert not torch.equal(batch["input_ids"][:, :3], other["input_ids"][:, :3])


# --------------------------------------------------------------------------- optimizer / scheduler


def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("name", ["torch.optim.AdamW", "AdamW"])
def test_build_optimizer_names_and_lr(name):
    opt = build_optimizer(_params(), {"name": name, "kwargs": {"weight_decay": 0.1, "betas": [0.9, 0.95]}}, 3e-4)
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert group["lr"] == 3e-4 and group["weight_decay"] == 0.1 and tuple(group["betas"]) == (0.9, 0.95)


def test_build_optimizer_object_config_and_explicit_lr():
    cfg = SimpleNamespace(name="SGD", kwargs={"lr": 0.5, "momentum": 0.9})
    opt = build_optimizer(_params(), cfg, default_lr=1.0)
    assert isinstance(opt, torch.optim.SGD)
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["momentum"] == 0.9


@pytest.mark.parametrize("name", ["NoSuchOptimizer", "torch.optim.Nope", "no_such_module.Adam", "torch.nn.Linear", ""])
def test_build_optimizer_bad_name(name):
    with pytest.raises(ValueError) as err:
        build_optimizer(_params(), {"name": name, "kwargs": {}}, 1e-3)
    assert repr(name) in str(err.value) or "non-empty" in str(err.value)


def _lrs(cfg, steps, base_lr=1.0):
    opt = build_optimizer(_params(), {"name": "SGD", "kwargs": {}}, base_lr)
    sched = build_scheduler(opt, cfg)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return sched, out


def test_scheduler_none_is_constant():
    sched, lrs = _lrs(None, 5, base_lr=0.3)
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR)
    assert lrs == [0.3] * 5
    assert sched.state_dict()["last_epoch"] == 5


def test_scheduler_single():
    cfg = [{"name": "torch.optim.lr_scheduler.LinearLR", "kwargs": {"start_factor": 0.5, "total_iters": 2}}]
    sched, lrs = _lrs(cfg, 4)
    assert type(sched) is torch.optim.lr_scheduler.LinearLR
    assert lrs == pytest.approx([0.5, 0.75, 1.0, 1.0])
    sched, _ = _lrs(cfg[0], 1)  # a bare config (not a list) works too
    assert type(sched) is torch.optim.lr_scheduler.LinearLR


@pytest.mark.parametrize(
    "milestones_entry",
    [
        {"name": "milestones", "milestones": [4]},
        {"milestones": [4]},  # NeMo-RL's spelling
        SimpleNamespace(name="milestones", milestones=[4]),
    ],
)
def test_scheduler_sequential_milestones(milestones_entry):
    cfg = [
        {"name": "LinearLR", "kwargs": {"start_factor": 0.1, "end_factor": 1.0, "total_iters": 4}},
        SimpleNamespace(name="ExponentialLR", kwargs={"gamma": 0.5}),
        milestones_entry,
    ]
    sched, lrs = _lrs(cfg, 8, base_lr=2.0)
    assert isinstance(sched, torch.optim.lr_scheduler.SequentialLR)
    # warmup 0.1 -> 1.0 over 4 steps (+0.225 per step), then halve every step from the milestone
    expected = [2.0 * f for f in (0.1, 0.325, 0.55, 0.775, 1.0, 0.5, 0.25, 0.125)]
    assert lrs == pytest.approx(expected)


@pytest.mark.parametrize(
    "cfg",
    [
        [{"name": "LinearLR", "kwargs": {}}, {"name": "ConstantLR", "kwargs": {}}],  # no milestones
        [
            {"name": "LinearLR", "kwargs": {}},
            {"name": "ConstantLR", "kwargs": {}},
            {"name": "milestones", "milestones": [1, 2]},
        ],
        [{"name": "LinearLR", "kwargs": {}}, {"name": "milestones", "milestones": [3]}],
        [
            {"name": "LinearLR", "kwargs": {}},
            {"name": "ConstantLR", "kwargs": {}},
            {"name": "ConstantLR", "kwargs": {}},
            {"name": "milestones", "milestones": [4, 2]},
        ],
    ],
)
def test_scheduler_milestone_count_mismatch(cfg):
    with pytest.raises(ValueError, match="milestone"):
        build_scheduler(build_optimizer(_params(), {"name": "SGD", "kwargs": {}}, 1.0), cfg)


def test_scheduler_bad_name():
    opt = build_optimizer(_params(), {"name": "SGD", "kwargs": {}}, 1.0)
    with pytest.raises(ValueError, match="NoSuchLR"):
        build_scheduler(opt, [{"name": "NoSuchLR", "kwargs": {}}])


# --------------------------------------------------------------------------- grad clipping


def _with_grads(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in [(4, 5), (7,), (2, 3, 2)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(dtype)
    params.append(torch.nn.Parameter(torch.zeros(2)))  # no grad: ignored
    return params


def _manual_norm(params, norm_type=2.0):
    flat = torch.cat([p.grad.double().flatten() for p in params if p.grad is not None])
    return flat.abs().max().item() if norm_type == float("inf") else flat.norm(norm_type).item()


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_none_only_measures(norm_type):
    params = _with_grads()
    before = [p.grad.clone() for p in params if p.grad is not None]
    norm = clip_grad_norm_(params, None, norm_type)
    assert isinstance(norm, float)
    assert norm == pytest.approx(_manual_norm(params, norm_type), rel=1e-6)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, params))


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_scales(norm_type):
    params = _with_grads(seed=3)
    true_norm = _manual_norm(params, norm_type)
    before = [p.grad.double().clone() for p in params if p.grad is not None]
    max_norm = true_norm / 4
    norm = clip_grad_norm_(params, max_norm, norm_type)
    assert norm == pytest.approx(true_norm, rel=1e-6)  # the pre-clip norm is returned
    coef = max_norm / (true_norm + 1e-6)
    for b, p in zip(before, params):
        torch.testing.assert_close(p.grad.double(), b * coef, rtol=1e-6, atol=1e-7)
    assert _manual_norm(params, norm_type) == pytest.approx(max_norm, rel=1e-5)

    # agrees with torch's own implementation
    ref = _with_grads(seed=3)
    torch_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type)
    assert norm == pytest.approx(torch_norm.item(), rel=1e-6)
    for a, p in zip(ref, params):
        if p.grad is not None:
            torch.testing.assert_close(a.grad, p.grad)


def test_clip_below_threshold_and_edge_cases():
    params = _with_grads(seed=1)
    before = [p.grad.clone() for p in params if p.grad is not None]
    clip_grad_norm_(params, _manual_norm(params) * 2, 2.0)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, params))
    assert clip_grad_norm_([torch.nn.Parameter(torch.zeros(2))], 1.0) == 0.0
    bf16 = _with_grads(seed=2, dtype=torch.bfloat16)
    assert clip_grad_norm_(bf16, None) == pytest.approx(_manual_norm(bf16), rel=1e-5)


# --------------------------------------------------------------------------- HF checkpoints


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen3", False)])
def test_save_hf_checkpoint_round_trip(tmp_path, tokenizer, arch, tied):
    src = transformers.AutoModelForCausalLM.from_pretrained(
        tm.build_tiny_model(tmp_path / "src", arch, tie_word_embeddings=tied)
    )
    with torch.no_grad():  # make weights differ from the built files
        for p in src.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = ckpt.save_hf_checkpoint(src.state_dict(), src.config, tmp_path / "out", tokenizer=tokenizer)
    files = set(os.listdir(out))
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= files
    assert ("lm_head.weight" in ckpt.load_hf_state_dict(out)) == (not tied)

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = tm.make_batch(tokenizer, 2, 5, 9, seed=0)["input_ids"]
    assert torch.equal(_logits(src, ids), _logits(loaded, ids))
    assert transformers.AutoTokenizer.from_pretrained(out).encode("x") == tokenizer.encode("x")
    assert siblings(Path(out)) == ["out", "src"]  # no temp or backup dirs left


def test_save_hf_checkpoint_sharded_with_dict_config(tmp_path, model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    state = model.state_dict()
    config = json.loads((Path(model_dir) / "config.json").read_text())
    out = Path(ckpt.save_hf_checkpoint(state, config, tmp_path / "sharded", max_shard_size_bytes=60_000))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 2 and not (out / "model.safetensors").exists()
    assert shard_files[0] == f"model-00001-of-{len(shard_files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())

    on_disk = ckpt.load_hf_state_dict(out)
    assert on_disk.keys() == state.keys()
    assert all(torch.equal(on_disk[k], state[k]) for k in state)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(_logits(model, ids), _logits(loaded, ids))


def test_save_hf_checkpoint_shared_storage_and_views(tmp_path):
    base = torch.arange(12, dtype=torch.float32)
    state = {"a": base.view(3, 4), "b": base.view(3, 4), "c": base[2:5], "d": base.view(4, 3).t()}
    out = ckpt.save_hf_checkpoint(state, {"model_type": "llama"}, tmp_path / "x")
    got = ckpt.load_hf_state_dict(out)
    for k, v in state.items():
        assert torch.equal(got[k], v)


def test_save_hf_checkpoint_streams_pairs_one_shard_at_a_time(tmp_path):
    """An iterable is written as it is consumed: a shard is on disk before the last tensor is asked for."""
    shapes = {f"layer{i}.w": (64, 64) for i in range(6)}  # 16 KiB each in float32
    expected = {name: torch.randn(shape) for name, shape in shapes.items()}
    expected["scale"] = torch.tensor(2.5, dtype=torch.bfloat16)
    expected["empty"] = torch.zeros(0, 3, dtype=torch.int64)
    written_before_end = []

    def pairs():
        for name, tensor in expected.items():
            yield name, tensor.clone()  # a fresh tensor each time, like a gather
        written_before_end.extend(tmp_path.glob(".out.tmp-*/.part-*.safetensors"))

    out = Path(ckpt.save_hf_checkpoint(pairs(), {"model_type": "llama"}, tmp_path / "out", max_shard_size_bytes=40_000))
    assert len(written_before_end) >= 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3  # two 16 KiB tensors per 40 kB shard
    got = ckpt.load_hf_state_dict(out)  # safetensors' own reader
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_save_hf_checkpoint_drops_a_streamed_tied_head(tmp_path):
    pairs = [("model.embed_tokens.weight", torch.ones(4, 2)), ("lm_head.weight", torch.ones(4, 2))]
    out = ckpt.save_hf_checkpoint(iter(pairs), {"tie_word_embeddings": True}, tmp_path / "x")
    assert list(ckpt.load_hf_state_dict(out)) == ["model.embed_tokens.weight"]


def test_save_hf_checkpoint_rejects_inconsistent_tie(tmp_path):
    state = {"model.embed_tokens.weight": torch.zeros(4, 2), "lm_head.weight": torch.ones(4, 2)}
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        ckpt.save_hf_checkpoint(state, {"tie_word_embeddings": True}, tmp_path / "x")
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- atomicity


def _write_version(directory: Path, version: str) -> None:
    (directory / "weights.bin").write_bytes(version.encode() * 1000)
    (directory / "sub").mkdir()
    (directory / "sub" / "meta.json").write_text(json.dumps({"version": version}))


def test_atomic_directory_fresh_and_replace(tmp_path):
    final = tmp_path / "ckpt" / "step_1"
    with ckpt.atomic_directory(final) as tmp:
        assert tmp.parent == final.parent and not final.exists()
        _write_version(tmp, "v1")
    assert json.loads((final / "sub" / "meta.json").read_text()) == {"version": "v1"}
    with ckpt.atomic_directory(final) as tmp:
        _write_version(tmp, "v2")
    assert json.loads((final / "sub" / "meta.json").read_text()) == {"version": "v2"}
    assert siblings(final) == ["step_1"]


def test_atomic_directory_exception_keeps_previous(tmp_path):
    final = tmp_path / "step_1"
    with ckpt.atomic_directory(final) as tmp:
        _write_version(tmp, "old")
    digest = tree_digest(final)

    with pytest.raises(RuntimeError, match="boom"):
        with ckpt.atomic_directory(final) as tmp:
            (tmp / "weights.bin").write_bytes(b"partial")
            raise RuntimeError("boom")
    assert tree_digest(final) == digest
    assert siblings(final) == ["step_1"]

    # same through save_hf_checkpoint, failing after the weights are written
    def broken_save(directory):
        assert (Path(directory) / "model.safetensors").exists()
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt.save_hf_checkpoint({"w": torch.ones(3)}, {}, final, tokenizer=SimpleNamespace(save_pretrained=broken_save))
    assert tree_digest(final) == digest
    assert siblings(final) == ["step_1"]


class _Crash(BaseException):
    """Stands for the process dying (not an Exception, so nothing catches it by accident)."""


def _crash_on_rename(monkeypatch, crash_at: int):
    real_rename = os.rename
    calls = []

    def rename(src, dst):
        calls.append((src, dst))
        if len(calls) == crash_at:
            raise _Crash
        return real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", rename)
    return calls


def test_crash_between_renames_is_recoverable(tmp_path, monkeypatch):
    final = tmp_path / "step_1"
    with ckpt.atomic_directory(final) as tmp:
        _write_version(tmp, "old")
    digest = tree_digest(final)

    calls = _crash_on_rename(monkeypatch, crash_at=2)  # old moved aside, new not yet in place
    with pytest.raises(_Crash):
        with ckpt.atomic_directory(final) as tmp:
            _write_version(tmp, "new")
    monkeypatch.undo()
    assert len(calls) == 2
    assert not final.exists()
    assert tree_digest(ckpt.backup_path(final)) == digest  # the old one is whole at the sibling

    assert ckpt.recover_checkpoint(final) is True
    assert tree_digest(final) == digest
    assert siblings(final) == ["step_1"]  # backup and the dead temp dir are gone
    assert ckpt.recover_checkpoint(final) is False  # idempotent

    with ckpt.atomic_directory(final) as tmp:  # and the next save works
        _write_version(tmp, "new")
    assert json.loads((final / "sub" / "meta.json").read_text()) == {"version": "new"}


def test_crash_after_publish_before_cleanup(tmp_path, monkeypatch):
    final = tmp_path / "step_1"
    with ckpt.atomic_directory(final) as tmp:
        _write_version(tmp, "old")
    monkeypatch.setattr(ckpt, "_remove", lambda path: (_ for _ in ()).throw(_Crash()))
    with pytest.raises(_Crash):
        with ckpt.atomic_directory(final) as tmp:
            _write_version(tmp, "new")
    monkeypatch.undo()
    assert ckpt.backup_path(final).exists()
    assert ckpt.recover_checkpoint(final) is False  # the new checkpoint is kept, backup dropped
    assert json.loads((final / "sub" / "meta.json").read_text()) == {"version": "new"}
    assert siblings(final) == ["step_1"]


def test_atomic_directory_recovers_first(tmp_path):
    final = tmp_path / "step_1"
    ckpt.backup_path(final).mkdir()
    _write_version(ckpt.backup_path(final), "old")
    with pytest.raises(RuntimeError):
        with ckpt.atomic_directory(final):
            raise RuntimeError
    assert json.loads((final / "sub" / "meta.json").read_text()) == {"version": "old"}


# --------------------------------------------------------------------------- torch state


def test_torch_state_round_trip(tmp_path):
    opt = build_optimizer(_params(), {"name": "SGD", "kwargs": {}}, 1.0)
    sched = build_scheduler(opt, None)
    state = {"step": 3, "scheduler": sched.state_dict(), "t": torch.arange(4), "rng": torch.get_rng_state()}
    path = tmp_path / "state" / "train_state.pt"
    ckpt.save_torch_state(state, path)
    ckpt.save_torch_state(state, path)  # overwrite in place
    loaded = ckpt.load_torch_state(path)
    assert loaded["step"] == 3 and torch.equal(loaded["t"], state["t"])
    assert loaded["scheduler"] == state["scheduler"]
    assert os.listdir(path.parent) == ["train_state.pt"]


_PWNED: list[str] = []


def _pwn():
    _PWNED.append("ran")
    return "pwned"


class _Evil:
    def __reduce__(self):
        return (_pwn, ())


def test_load_torch_state_rejects_arbitrary_pickle(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"x": _Evil()}, path)  # plain torch.save writes any pickle
    with pytest.raises(pickle.UnpicklingError):
        ckpt.load_torch_state(path)
    assert _PWNED == []


def test_pydantic_config_objects():
    policy = pytest.importorskip("rlcore.config.policy")
    opt = build_optimizer(_params(), policy.PytorchOptimizerConfig(name="torch.optim.AdamW", kwargs={}), 0.5)
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["lr"] == 0.5
    cfg = [
        policy.SinglePytorchSchedulerConfig(
            name="torch.optim.lr_scheduler.ConstantLR", kwargs={"factor": 0.5, "total_iters": 10}
        ),
        policy.SinglePytorchSchedulerConfig(
            name="torch.optim.lr_scheduler.LinearLR", kwargs={"start_factor": 1.0, "end_factor": 0.0, "total_iters": 2}
        ),
        policy.SchedulerMilestones(name="milestones", milestones=[2]),
    ]
    sched = build_scheduler(opt, cfg)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.25, 0.25, 0.5, 0.25])
