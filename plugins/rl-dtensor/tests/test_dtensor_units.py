"""Fast, single-process tests of the pieces: backend selection, context-parallel refusal, packed forwards,
the gradient-norm rule, and the restricted reader of DCP metadata."""

from __future__ import annotations

import pickle

import pytest
import torch

from rlcore.config import ConfigError, load_config_dict, resolve


def test_dtensor_is_selected_by_default_and_by_name(tiny_model_dir):
    assert load_config_dict({"policy": {"model_name": tiny_model_dir}}).policy.training_backend == "dtensor"
    cfg = load_config_dict({"policy": {"backend": "dtensor", "dtensor_cfg": {"enabled": False}}})
    assert cfg.policy.training_backend == "dtensor"
    from rlcore.plugins import get_registry

    spec = get_registry().resolve("dtensor", kind="training")
    assert spec.worker_class == "rl_dtensor.worker:DTensorPolicyWorker"
    assert {"tensor_parallel", "sequence_parallel", "sequence_packing", "refit", "checkpoint"} <= spec.capabilities


def test_context_parallel_is_refused_on_cpu():
    with pytest.raises(ConfigError, match=r"policy\.dtensor_cfg\.context_parallel_size"):
        resolve(
            load_config_dict(
                {"cluster": {"workers_per_node": 2}, "policy": {"dtensor_cfg": {"context_parallel_size": 2}}}
            )
        )
    # The worker refuses too (a config built without the CPU check, e.g. cluster.use_gpu on a CPU box).
    from rl_dtensor.worker import check_context_parallel

    check_context_parallel(1, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"policy\.dtensor_cfg\.context_parallel_size=2 needs CUDA"):
        check_context_parallel(2, torch.device("cpu"))


def _colwise():
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel()


CUSTOM_PLAN = {"lm_head": _colwise()}


def test_unknown_architecture_needs_a_custom_plan():
    from types import SimpleNamespace

    from rl_dtensor.tp_plans import import_plan, plan_for

    model = SimpleNamespace(config=SimpleNamespace(model_type="gpt2"))
    with pytest.raises(ValueError, match="custom_parallel_plan"):
        plan_for(model, sequence_parallel=True)
    with pytest.raises(ValueError, match="cannot import 'no_such_module:plan'"):
        import_plan("no_such_module:plan", model, True)
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    assert isinstance(import_plan("test_dtensor_units:custom_plan", model, True)["lm_head"], ColwiseParallel)
    assert isinstance(import_plan("test_dtensor_units:custom_plan", model, False)["lm_head"], RowwiseParallel)
    assert list(import_plan("test_dtensor_units.CUSTOM_PLAN", model, False)) == ["lm_head"]
    with pytest.raises(ValueError, match="must be"):
        import_plan("test_dtensor_units:NOT_A_PLAN", model, False)


def custom_plan(model, sequence_parallel):
    """A user plan given as a callable ``(model, sequence_parallel) -> plan``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"lm_head": ColwiseParallel() if sequence_parallel else RowwiseParallel()}


NOT_A_PLAN = {"lm_head": "colwise"}


# -- packed forwards ----------------------------------------------------------------------------


def test_block_causal_mask():
    from rl_dtensor.inputs import block_causal_mask

    mask = block_causal_mask(torch.tensor([0, 0, 1, 1, 1]), "sdpa", torch.float32)[0, 0]
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(mask, expected)
    additive = block_causal_mask(torch.tensor([0, 0, 1, 1, 1]), "eager", torch.float32)[0, 0]
    assert torch.equal(additive == 0, expected) and (additive[~expected] == torch.finfo(torch.float32).min).all()


@pytest.mark.parametrize("attn", ["sdpa", "eager", "segments"])
@pytest.mark.parametrize("multiple", [1, 4])
def test_packed_forward_equals_padded_forward(tiny_model_dir, tiny_tokenizer, attn, multiple):
    """One packed row (block-diagonal mask, or segment attention) gives each sequence's padded-batch
    logprobs and top-k."""
    from transformers import AutoModelForCausalLM

    from rl_dtensor.inputs import packed_inputs, padded_inputs
    from rl_dtensor.segment_attention import use_segment_attention
    from rlcore.testing.models import make_batch

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa" if attn == "segments" else attn
    )
    if attn == "segments":
        assert use_segment_attention(model)
    mb = make_batch(tiny_tokenizer, 5, 2, 13, seed=3)
    cpu = torch.device("cpu")
    padded = padded_inputs(mb, cpu, multiple)
    packed = packed_inputs(mb, cpu, model.config._attn_implementation, torch.float32, multiple)
    assert (packed.attention_mask is None) == (attn == "segments")
    assert packed.input_ids.shape[0] == 1 and packed.input_ids.shape[1] % multiple == 0
    with torch.no_grad():
        logits_padded = model(**padded.model_kwargs()).logits
        logits_packed = model(**packed.model_kwargs()).logits
    assert float((packed.logprobs(logits_packed) - padded.logprobs(logits_padded)).abs().max()) <= 1e-5
    valid_rows = torch.arange(mb["input_ids"].shape[1] - 1)[None, :] < (mb["input_lengths"][:, None] - 1)
    diff = (packed.topk(logits_packed, 3)[0] - padded.topk(logits_padded, 3)[0]).abs().amax(-1)
    assert float((diff * valid_rows).max()) <= 1e-5


def test_segment_attention_gradients_equal_the_padded_batch(tiny_model_dir, tiny_tokenizer):
    """Backward through segment attention: the same parameter gradients as the padded batch (float64)."""
    from transformers import AutoModelForCausalLM

    from rl_dtensor.inputs import packed_inputs, padded_inputs
    from rl_dtensor.segment_attention import use_segment_attention
    from rlcore.testing.models import make_batch

    mb = make_batch(tiny_tokenizer, 6, 2, 17, seed=5)
    cpu = torch.device("cpu")
    grads = []
    for inputs in (padded_inputs(mb, cpu), None):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
        if inputs is None:
            assert use_segment_attention(model)
            inputs = packed_inputs(mb, cpu, model.config._attn_implementation, torch.float64)
        inputs.logprobs(model(**inputs.model_kwargs()).logits).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-9, atol=1e-10)


def test_segment_attention_is_not_used_where_attention_is_not_plain_causal(tiny_model_dir):
    from transformers import AutoConfig

    from rl_dtensor.segment_attention import can_use_segment_attention

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config._attn_implementation = "sdpa"
    assert can_use_segment_attention(config)
    config.layer_types = ["full_attention", "sliding_attention"] * (config.num_hidden_layers // 2)
    assert not can_use_segment_attention(config)
    config.layer_types, config._attn_implementation = None, "eager"
    assert not can_use_segment_attention(config)


# -- gradient norm over mixed meshes ------------------------------------------------------------


def test_replica_count_treats_fsdp_strided_shards_as_shards():
    """FSDP over a TP-sharded weight gives ``(_StridedShard, Shard)``: distinct pieces, not copies."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from rl_dtensor.grads import replica_count

    assert replica_count((_StridedShard(0, split_factor=2), Shard(0)), (2, 2), world=4) == 1
    assert replica_count((Shard(0), Replicate()), (2, 2), world=4) == 2  # a norm weight under SP
    assert replica_count((Shard(0),), (2,), world=4) == 2  # a dp-only DTensor in a dp x tp world
    assert replica_count(None, None, world=4) == 4  # a plain tensor on every rank


# -- DCP metadata is not read with unrestricted pickle --------------------------------------------


class _Boom:
    def __reduce__(self):
        return (exec, ("raise SystemExit('pickle payload ran')",))


def test_dcp_reader_loads_real_checkpoints_and_refuses_foreign_objects(tmp_path):
    import torch.distributed.checkpoint as dcp

    from rlcore.training.sharded_checkpoint import SafeFileSystemReader

    state = {"w": torch.randn(3, 4), "step": torch.tensor(7), "h": torch.ones(2, dtype=torch.bfloat16)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ok")), no_dist=True)
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, storage_reader=SafeFileSystemReader(str(tmp_path / "ok")), no_dist=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)

    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to load builtins\.exec"):
        SafeFileSystemReader(str(tmp_path / "evil")).read_metadata()


@pytest.mark.parametrize("chunk", [None, 3])
def test_logprobs_take_the_chunked_path_only_when_asked(chunk):
    """``gather_logprobs`` (what the worker calls with ``policy.logprob_chunk_size``) on whole-vocabulary logits;
    the split-vocabulary path is
    tests/training/test_chunked_logprobs.py's gloo test and the kit's ``chunked`` variant."""
    from rl_dtensor.vocab_parallel import gather_logprobs

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 29, generator=gen, requires_grad=True)
    target = torch.randint(0, 29, (2, 7), generator=gen)
    lp = gather_logprobs(logits, target, 0.7, chunk)
    expected = (logits.double() / 0.7).log_softmax(-1).gather(-1, target[..., None]).squeeze(-1)
    assert (lp.double() - expected).abs().max() < 1e-5
    assert (type(lp.grad_fn).__name__ == "ChunkedLogprobBackward") == (chunk is not None)
