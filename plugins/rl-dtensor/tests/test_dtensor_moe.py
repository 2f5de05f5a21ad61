"""A mixture-of-experts model (tiny-qwen3-moe: 8 experts, top-2) on the dtensor backend, FSDP2 over dp=2 ranks,
against a single-process float64 Hugging Face reference written here.

One policy serves every test: started with ``policy.hf_config_overrides`` that turn the router's
load-balancing loss on (``output_router_logits``, a larger ``router_aux_loss_coef`` so its gradient shows)
and change a number of the forward (``rms_norm_eps``). It computes logprobs, then makes one SGD step of
NLL + aux loss (``rlcore.training.moe_aux``'s rule: each micro-batch's HF aux loss weighted by its share of the
step's routed tokens over both ranks; micro-batches of one sample, one row's ``sample_mask`` 0).

Tolerance: 1e-5, relative for the loss, the aux loss and the grad norm, absolute for logprobs and weights
(SGD: a weight's error is ``lr`` times its gradient's). The backend computes in float32, so this is the float32
error of its forward and backward, well below the negative controls' gaps (4e-4 in the router weights without
the aux term, over 1e-3 in logprobs without the overrides).
"""

from __future__ import annotations

import math

import pytest
import torch
from dtensor_testlib import LR, call_all, full_weights, max_abs_diff, policy_config, valid_diff
from dtensor_testlib import batch as make_data

from rlcore.algorithms.loss_functions import NLLLoss

TOL = 1e-5
OVERRIDES = {"output_router_logits": True, "router_aux_loss_coef": 0.5, "rms_norm_eps": 0.05}


@pytest.fixture(scope="module")
def moe_path() -> str:
    from rlcore.models import resolve_model

    return resolve_model("tiny-qwen3-moe")


@pytest.fixture(scope="module")
def data(tiny_tokenizer):
    d = make_data(tiny_tokenizer)
    d["sample_mask"][3] = 0.0  # a row that counts for neither the NLL nor the routing balance
    return d


@pytest.fixture(scope="module")
def run(ray_session, moe_path, tiny_tokenizer, data, tmp_path_factory):
    """One 2-rank policy: its logprobs, one SGD step's result and its weights after it; the refit metadata and a
    checkpoint of the trained weights; its logprobs after loading the initial checkpoint back."""
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy

    cluster = RayVirtualCluster([2])
    cfg = policy_config(moe_path, hf_config_overrides=OVERRIDES)
    policy = Policy(cluster, cfg, tiny_tokenizer, name_prefix="dt-moe")
    saved = str(tmp_path_factory.mktemp("moe") / "weights")
    try:
        layout = call_all(policy, "is_dtensor_model")[0]
        logprobs = policy.get_logprobs(data)["logprobs"]
        out = policy.train(data, NLLLoss())
        weights = full_weights(policy)
        refit_info = call_all(policy, "prepare_refit_info")[0]
        call_all(policy, "save_checkpoint", saved)
        call_all(policy, "load_checkpoint", moe_path)  # the per-expert files back into the fused experts
        reloaded = policy.get_logprobs(data)["logprobs"]
    finally:
        policy.shutdown()
        cluster.shutdown()
    return {
        "layout": layout,
        "logprobs": logprobs,
        "out": out,
        "weights": weights,
        "refit_info": refit_info,
        "saved": saved,
        "reloaded": reloaded,
    }


def hf_float64(path: str, overrides: dict) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, **overrides)
    # The per-expert loop: an implementation of its own (the backend runs grouped_mm, which has no float64).
    return AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float64, experts_implementation="eager"
    )


def switch_aux_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Hugging Face's load-balancing loss of one unpadded sequence, in float64 (f_e * P_e over all layers)."""
    experts = router_logits[0].shape[-1]
    probs = [torch.softmax(layer.double(), dim=-1) for layer in router_logits]
    rows = sum(p.shape[0] for p in probs)
    assigned = sum(torch.nn.functional.one_hot(p.topk(top_k).indices, experts).sum((0, 1)).double() for p in probs)
    mean_prob = sum(p.sum(0) for p in probs) / rows
    return experts * torch.sum(assigned / rows * mean_prob)


def reference_step(path: str, overrides: dict, data) -> dict:
    """One SGD step of NLL + coef * aux in float64, one sequence at a time without padding; and, for the
    negative control, the weights the step would give without the aux term."""
    model = hf_float64(path, overrides)
    coef = model.config.router_aux_loss_coef
    lengths, keep, token_mask = data["input_lengths"], data["sample_mask"].double(), data["token_mask"].double()
    valid_tokens = float((token_mask[:, 1:] * keep[:, None]).sum())
    routed = float((lengths.double() * keep).sum())
    nll, aux = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    logprobs = torch.zeros(data["input_ids"].shape, dtype=torch.float64)
    for i, length in enumerate(lengths.tolist()):
        ids = data["input_ids"][i : i + 1, :length]
        out = model(input_ids=ids, output_router_logits=True, use_cache=False)
        lp = torch.log_softmax(out.logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        logprobs[i, 1:length] = lp.detach()
        nll = nll - (lp * token_mask[i, 1:length]).sum() * keep[i] / valid_tokens
        seq_aux = switch_aux_loss(out.router_logits, model.config.num_experts_per_tok)
        hf_aux = float(out.aux_loss.detach())  # HF's own definition (computed in float32)
        assert abs(float(seq_aux.detach()) - hf_aux) <= 1e-6 * hf_aux
        aux = aux + seq_aux * length * keep[i] / routed
    params = dict(model.named_parameters())
    nll_grads = torch.autograd.grad(nll, list(params.values()), retain_graph=True)
    aux_grads = torch.autograd.grad(aux, list(params.values()), allow_unused=True)
    grads = {
        name: g + (0.0 if a is None else coef * a) for name, g, a in zip(params, nll_grads, aux_grads, strict=True)
    }
    norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
    with torch.no_grad():
        weights = {name: (p - LR * grads[name]).float() for name, p in params.items()}
        without_aux = {name: (p - LR * g).float() for (name, p), g in zip(params.items(), nll_grads, strict=True)}
    return {
        "loss": float(nll + coef * aux),
        "aux": float(aux),
        "grad_norm": norm,
        "weights": weights,
        "weights_without_aux": without_aux,
        "logprobs": logprobs,
    }


@pytest.fixture(scope="module")
def reference(moe_path, data):
    return reference_step(moe_path, OVERRIDES, data)


def test_experts_are_sharded_by_fsdp2_over_dp(run):
    layout = run["layout"]
    assert layout["model.layers.0.mlp.experts.gate_up_proj"] == 1 and layout["model.layers.0.mlp.gate.weight"] == 1


def test_overridden_config_gives_hf_s_forward_with_that_config(run, moe_path, data, reference):
    """policy.hf_config_overrides reaches the trained model: its logprobs are those of an HF model built with the
    overridden config, and not those of the checkpoint's own config (negative control)."""
    got = run["logprobs"]
    assert valid_diff(got, reference["logprobs"].float(), data["input_lengths"]) <= TOL
    with torch.no_grad():
        plain = hf_float64(moe_path, {})
        ids, lengths = data["input_ids"], data["input_lengths"]
        valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        logits = plain(input_ids=ids, attention_mask=valid.long(), use_cache=False).logits[:, :-1]
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    unchanged = torch.where(valid[:, 1:], lp, torch.zeros_like(lp)).float()
    assert float((got[:, 1:] - unchanged).abs().max()) > 1e-3


def test_moe_step_with_router_aux_loss_matches_float64_reference(run, reference):
    out = run["out"]
    print(  # the measured gaps (pytest -s)
        "loss",
        abs(float(out["loss"][0]) - reference["loss"]),
        "aux",
        abs(sum(out["all_mb_metrics"]["moe_aux_loss"]) - reference["aux"]),
        "norm",
        abs(float(out["grad_norm"][0]) - reference["grad_norm"]),
        "weights",
        max_abs_diff(run["weights"], reference["weights"]),
        "reference",
        reference["loss"],
        reference["aux"],
        reference["grad_norm"],
    )
    loss, norm = float(out["loss"][0]), float(out["grad_norm"][0])
    aux = sum(out["all_mb_metrics"]["moe_aux_loss"])
    assert abs(loss - reference["loss"]) <= TOL * abs(reference["loss"])
    assert abs(aux - reference["aux"]) <= TOL * reference["aux"]
    assert abs(norm - reference["grad_norm"]) <= TOL * reference["grad_norm"]
    worst, name = max_abs_diff(run["weights"], reference["weights"])
    assert worst <= TOL, f"{name} differs from the float64 reference by {worst:.3g}"


def test_negative_control_the_aux_loss_is_in_the_step(run, reference):
    """The same reference step without the aux term: the router weights it gives are far from the policy's."""
    gaps = {
        name: float((run["weights"][name].double() - w.double()).abs().max())
        for name, w in reference["weights_without_aux"].items()
        if name.endswith("mlp.gate.weight")
    }
    assert gaps and min(gaps.values()) > 10 * TOL, gaps  # measured: 4.3e-4 and 5.0e-4


def test_refit_and_checkpoints_use_the_checkpoint_s_per_expert_names(run, moe_path, data, reference):
    """The fused experts leave as the files' per-expert tensors (what vLLM and HF tools load): the refit metadata
    is the original checkpoint's names and shapes, the saved checkpoint loads with from_pretrained into the trained
    weights, and the original files load back into the fused experts (the initial logprobs again)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with safe_open(f"{moe_path}/model.safetensors", "pt") as files:
        expected = {name: tuple(files.get_slice(name).get_shape()) for name in files.keys()}  # noqa: SIM118
    assert {name: tuple(shape) for name, (shape, _) in run["refit_info"].items()} == expected
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in run["refit_info"]
    loaded = AutoModelForCausalLM.from_pretrained(run["saved"], dtype=torch.float32, experts_implementation="eager")
    worst, name = max_abs_diff(dict(loaded.named_parameters()), run["weights"])
    assert worst == 0.0, f"{name}: {worst:.3g}"
    assert valid_diff(run["reloaded"], run["logprobs"], data["input_lengths"]) <= TOL


def test_tensor_parallel_is_refused_for_experts(moe_path):
    """tp 2 on a MoE model: one line naming the setting, the reason and the ways out."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl_dtensor.parallelize import check_no_experts

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(moe_path))
    with pytest.raises(ValueError, match=r"^policy\.dtensor_cfg\.tensor_parallel_size=2: .*megatron"):
        check_no_experts(model, 2)


@pytest.mark.parametrize(
    ("policy", "line"),
    [
        ({"dtensor_cfg": {"tensor_parallel_size": 2}}, r"policy\.dtensor_cfg\.tensor_parallel_size: is 2, .*8 experts"),
        ({"dtensor_cfg": {"expert_parallel_size": 2}}, r"policy\.dtensor_cfg\.expert_parallel_size: is 2, .*megatron"),
        ({"hf_config_overrides": {"moe_capacity_factor": 1.25}}, r"policy\.hf_config_overrides\.moe_capacity_factor: "),
        ({"hf_config_overrides": {"num_experts": 4}}, r"policy\.hf_config_overrides: setting num_experts changes"),
    ],
)
def test_moe_settings_this_backend_cannot_honour_fail_before_any_process_starts(moe_path, policy, line):
    from rlcore.config import ConfigError, load_config_dict, resolve

    raw = {"cluster": {"workers_per_node": 2}, "policy": {"model_name": moe_path, **policy}}
    with pytest.raises(ConfigError, match=line) as info:
        resolve(load_config_dict(raw))
    assert len(info.value.problems) == 1, info.value.problems


def test_packed_and_padded_forwards_give_one_aux_loss(moe_path, data):
    """Sequence packing lays the tokens out differently (one row, a padded tail): the routed tokens and the aux
    loss are the padded layout's (single process, the backend's input builders and the router recorder)."""
    from transformers import AutoModelForCausalLM

    from rl_dtensor.inputs import packed_inputs, padded_inputs
    from rlcore.training.moe_aux import RouterLogitsRecorder, load_balancing_loss, routed_tokens

    model = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32)
    recorder = RouterLogitsRecorder(model)
    cpu = torch.device("cpu")

    def aux_of(inputs) -> tuple[float, int]:
        with torch.no_grad(), recorder.recording() as router_logits:
            model(**inputs.model_kwargs())
        mask = inputs.routed_mask(data["sample_mask"])
        assert len(router_logits) == model.config.num_hidden_layers
        return float(load_balancing_loss(router_logits, mask, model.config.num_experts_per_tok)), int(mask.sum())

    padded = aux_of(padded_inputs(data, cpu))
    packed = aux_of(packed_inputs(data, cpu, model.config._attn_implementation, torch.float32, multiple=8))
    recorder.remove()
    assert padded[1] == packed[1] == int(routed_tokens(data))
    assert abs(padded[0] - packed[0]) <= TOL * padded[0]


def test_activation_checkpointing_counts_each_router_once(moe_path, data):
    """A checkpointed layer runs its router again in backward: those logits are not recorded, and the aux loss's
    gradients are those of the model without checkpointing (single process)."""
    from transformers import AutoModelForCausalLM

    from rl_dtensor.inputs import padded_inputs
    from rl_dtensor.parallelize import apply_ac
    from rlcore.training.moe_aux import RouterLogitsRecorder, load_balancing_loss

    inputs = padded_inputs(data, torch.device("cpu"))
    mask = inputs.routed_mask(data["sample_mask"])
    grads = []
    for checkpointed in (False, True):
        model = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32)
        if checkpointed:
            apply_ac(model)
        recorder = RouterLogitsRecorder(model)
        with recorder.recording() as router_logits:
            logits = model(**inputs.model_kwargs()).logits
        loss = logits.square().mean() + load_balancing_loss(router_logits, mask, model.config.num_experts_per_tok)
        loss.backward()
        assert len(recorder.logits) == model.config.num_hidden_layers  # nothing added by the recomputation
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    worst, name = max_abs_diff(grads[0], grads[1])
    assert worst <= 1e-6, f"{name}: {worst:.3g}"
