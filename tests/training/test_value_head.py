"""``rlcore.training.value_head``: the value alignment (padded and packed), the Hugging Face value-model format and
loader, and a value model's step hooks (in one process, against plain per-sequence computations)."""

from __future__ import annotations

import logging

import pytest
import torch

from rlcore.data.packing import pack_microbatch
from rlcore.training.hf_config import load_config
from rlcore.training.loop import StepHooks
from rlcore.training.value_head import (
    NoTokenDistributionError,
    aligned_values,
    check_model_head,
    load_value_model,
    value_model_config,
    value_step_hooks,
)


@pytest.fixture(scope="module")
def llama() -> str:
    from rlcore.models import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="module")
def value_model(llama):
    return load_value_model(llama, value_model_config(load_config(llama))).eval()


def sequences(lengths: list[int], width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (len(lengths), width), generator=gen)
    lens = torch.tensor(lengths)
    ids[torch.arange(width)[None, :] >= lens[:, None]] = 0
    return ids, lens


def test_aligned_values_shift_like_logprobs_and_zero_position_0_and_padding():
    head = torch.arange(1.0, 13.0).reshape(2, 6).requires_grad_()
    values = aligned_values(head[..., None], torch.tensor([6, 3]))
    expected = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 7, 8, 0, 0, 0]], dtype=torch.float32)
    assert values.dtype == torch.float32 and torch.equal(values, expected)
    values.sum().backward()  # differentiable: each head output used once, at the next position
    assert torch.equal(head.grad, torch.tensor([[1.0, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]]))


def test_packed_values_equal_each_sequence_s_own_forward(value_model):
    """A packed row run sequence by sequence (the attention a packed forward must give) gives the padded values."""
    ids, lengths = sequences([7, 3, 5], 8)
    packed = pack_microbatch(ids, lengths)
    with torch.no_grad():
        mask = (torch.arange(8)[None, :] < lengths[:, None]).long()
        padded = aligned_values(value_model(input_ids=ids, attention_mask=mask).logits, lengths)
        own = [value_model(input_ids=ids[b : b + 1, : int(n)]).logits[0] for b, n in enumerate(lengths)]
        tail = torch.full((3, 1), 99.0)  # padding past the packing's width (sequence parallel) is ignored
        flat = torch.cat([*own, tail])[None]
        from_packed = aligned_values(flat, lengths, packed)
    assert float((from_packed - padded).abs().max()) < 1e-6
    assert (padded[:, 0] == 0).all() and (padded[1, 3:] == 0).all() and (padded[1, 1:3] != 0).all()


def test_causal_lm_checkpoint_loads_its_trunk_and_a_seeded_fresh_head(llama, value_model, caplog):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).state_dict()
    state = value_model.state_dict()
    assert "lm_head.weight" not in state and {"score.weight", "score.bias"} <= set(state)
    assert all(torch.equal(state[k], lm[k]) for k in state if not k.startswith("score."))
    config = value_model.config
    assert config.num_labels == 1 and config.classifier_dropout == 0.0
    assert config.architectures == ["LlamaForTokenClassification"]
    assert torch.equal(state["score.bias"], torch.zeros(1))
    assert 0.5 < float(state["score.weight"].std()) / config.initializer_range < 1.5
    before = torch.random.get_rng_state()
    with caplog.at_level(logging.INFO, logger="rlcore.training.value_head"):
        again = load_value_model(llama, value_model_config(load_config(llama)))
    assert torch.equal(torch.random.get_rng_state(), before), "the loader must leave torch's generator as it was"
    assert torch.equal(again.score.weight, value_model.score.weight), "the fresh head is seeded"
    assert any("has no value head" in r.getMessage() and "initialised score" in r.getMessage() for r in caplog.records)


def test_one_label_checkpoint_loads_whole_and_other_label_counts_are_refused(value_model, tmp_path, caplog):
    with torch.no_grad():
        value_model.score.weight.fill_(0.25)
        value_model.score.bias.fill_(-1.5)
    value_model.save_pretrained(tmp_path / "value")
    with caplog.at_level(logging.INFO, logger="rlcore.training.value_head"):
        loaded = load_value_model(str(tmp_path / "value"), value_model_config(load_config(str(tmp_path / "value"))))
    assert not [r for r in caplog.records if "has no value head" in r.getMessage()]
    assert torch.equal(loaded.score.bias, torch.tensor([-1.5])) and (loaded.score.weight == 0.25).all()
    three = load_config(str(tmp_path / "value"))
    three.num_labels = 3
    with pytest.raises(ValueError, match="token-classification model with 3 labels; a value model has one"):
        value_model_config(three)


def test_value_step_hooks_feed_values_and_refuse_loss_inputs():
    def logprobs(mb):
        raise AssertionError("a value model's step must not compute logprobs")

    hooks = StepHooks(
        forward=logprobs,
        all_reduce_sum=lambda t: None,
        finish_grads=lambda: None,
        clip_grads=lambda n: 0.0,
        optimizer_step=lambda: None,
        zero_grad=lambda: None,
        forward_with_inputs=lambda mb, names: (torch.zeros(1), {}),
    )
    values = value_step_hooks(hooks, lambda mb: torch.ones(1), ())
    assert values.forward({}).item() == 1.0 and values.forward_with_inputs is None
    assert values.optimizer_step is hooks.optimizer_step
    with pytest.raises(NoTokenDistributionError, match="entropy: a value model has no token distribution"):
        value_step_hooks(hooks, lambda mb: torch.ones(1), ("entropy",))
    assert check_model_head("value") == "value"
    with pytest.raises(ValueError, match="model_head='critic'"):
        check_model_head("critic")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_architectures_load_as_their_token_classification_class(arch):
    from transformers import AutoModelForCausalLM

    from rlcore.models import tiny_model_path

    path = tiny_model_path(arch=arch)
    model = load_value_model(path, value_model_config(load_config(path)))
    assert type(model).__name__ == model.config.architectures[0] == f"{arch.capitalize()}ForTokenClassification"
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    state = model.state_dict()
    assert all(torch.equal(state[k], lm[k]) for k in state if not k.startswith("score."))
    assert tuple(state["score.weight"].shape) == (1, model.config.hidden_size)
