"""The LoRA section of the training kit, run for backends declaring the 'lora' capability.

The oracle is PEFT itself, single process: the backend's initial adapters
(saved before any step) are loaded with ``peft.PeftModel.from_pretrained``
over the base model, and one plain SGD step is taken on the whole batch.
The backend's step must give the same adapters, its checkpoint must load with
PEFT (and its ``merged/`` weights with ``AutoModelForCausalLM``), the base
weights must not move, and the reference policy must be the base model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The kit's LoRA settings: every linear layer of the tiny Llama, rank 4, scale 2, no dropout.
LORA_SETTINGS = {
    "enabled": True,
    "dim": 4,
    "alpha": 8,
    "dropout": 0.0,
    "match_all_linear": True,
    "lora_A_init": "uniform",
    "save_merged": True,
}


@dataclass
class PeftStep:
    """What the PEFT oracle's step produced: its loss, adapters and logprobs after the step."""

    loss: float
    adapters: dict
    initial_adapters: dict
    logprobs: Any


def peft_model(base_dir: str, adapter_dir: str | Path, trainable: bool = False) -> Any:
    """The base model (float32) with a PEFT-format adapter directory loaded over it."""
    from peft import PeftModel

    from rlcore.testing.oracle import load_hf_model

    return PeftModel.from_pretrained(load_hf_model(base_dir), str(adapter_dir), is_trainable=trainable)


def peft_adapters(model: Any) -> dict:
    """``{layer path.lora_X.weight: tensor}`` of a PEFT model (the adapter name dropped, as in its files)."""
    out = {}
    for name, p in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            name = name.removeprefix("base_model.model.").replace(".default.", ".")
            out[name] = p.detach().clone()
    return out


def peft_sgd_step(base_dir: str, adapter_dir: str | Path, data: Any, loss_fn: Any, lr: float) -> PeftStep:
    """One plain SGD step of the adapters on all of ``data``, in this process, with PEFT."""
    import torch

    from rlcore.testing.oracle import hf_token_logprobs, oracle_gradients

    model = peft_model(base_dir, adapter_dir, trainable=True)
    model.train()
    initial = peft_adapters(model)
    loss, grads = oracle_gradients(model, data, loss_fn)
    frozen = [n for n in grads if ".lora_" not in n]
    assert not frozen, f"PEFT oracle: gradients reached frozen weights {frozen[:3]}"
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, grad in grads.items():
            params[name] -= lr * grad
        model.eval()
        logprobs = hf_token_logprobs(model, data)
    return PeftStep(loss, peft_adapters(model), initial, logprobs)


def base_weight_problems(merged_dir: Path, adapter_dir: Path, base_dir: str, scaling: float) -> list[str]:
    """The base weights did not move: merged - scaling * B @ A is the initial weight of every adapted layer,
    and every other tensor of ``merged/`` is bit-identical to the base model's."""
    from rlcore.testing.oracle import load_hf_model

    merged = load_hf_model(str(merged_dir)).state_dict()
    base = load_hf_model(base_dir).state_dict()
    adapters = peft_adapters(peft_model(base_dir, adapter_dir))
    problems = []
    for name, tensor in base.items():
        path = name.removesuffix(".weight")
        a, b = adapters.get(path + ".lora_A.weight"), adapters.get(path + ".lora_B.weight")
        if a is None:
            if not bool((merged[name] == tensor).all()):
                problems.append(
                    f"{name} (not adapted) changed: max |diff| {float((merged[name] - tensor).abs().max()):.3g}"
                )
            continue
        err = float((merged[name] - scaling * (b @ a) - tensor).abs().max())
        if err > 1e-5:
            problems.append(
                f"{name}: merged - scaling * B @ A differs from the initial weight by {err:.3g}: "
                "the frozen base weight moved"
            )
    return problems


# -- resume from an adapter checkpoint --------------------------------------------------------


@dataclass
class LoRAResumeRun:
    """Per step ``(loss, grad norm, probe logprobs)``: uninterrupted, and resumed from the checkpoint."""

    uninterrupted: list[tuple[float, float, Any]]
    resumed: list[tuple[float, float, Any]]
    checkpoint_step: int
    restored: Any  # the resumed policy's probe logprobs before it trains


def run_lora_resume(
    start: Callable[..., Any],
    stop: Callable[[str], None],
    steps: list[tuple[Any, Any]],
    probe: Any,
    tmp_dir: Path,
    checkpoint_step: int = 1,
) -> LoRAResumeRun:
    """Train uninterrupted, checkpointing adapters and optimizer after ``checkpoint_step``; then a new
    policy (``start(name, weights_path=..., optimizer_path=...)``) resumes from there."""
    weights, optimizer = tmp_dir / "lora-resume-checkpoint", tmp_dir / "lora-resume-optim"

    def step(policy: Any, data: Any, loss_fn: Any) -> tuple[float, float, Any]:
        result = policy.train(data, loss_fn)
        return float(result["loss"][0]), float(result["grad_norm"][0]), policy.get_logprobs(probe)["logprobs"]

    policy = start("lora-adam")
    try:
        uninterrupted = []
        for k, (data, loss_fn) in enumerate(steps, start=1):
            uninterrupted.append(step(policy, data, loss_fn))
            if k == checkpoint_step:
                policy.save_checkpoint(str(weights), str(optimizer))
    finally:
        stop("lora-adam")
    policy = start("lora-resumed", weights_path=str(weights), optimizer_path=str(optimizer))
    try:
        restored = policy.get_logprobs(probe)["logprobs"]
        resumed = [step(policy, data, loss_fn) for data, loss_fn in steps[checkpoint_step:]]
    finally:
        stop("lora-resumed")
    return LoRAResumeRun(uninterrupted, resumed, checkpoint_step, restored)


def lora_resume_problems(
    run: LoRAResumeRun, lengths: Any, logprob_atol: float, exact_atol: float, exact_rtol: float
) -> list[str]:
    """Everything that differs between the resumed steps and the uninterrupted ones."""
    from rlcore.testing.conformance.checkers import logprob_problems

    k = run.checkpoint_step
    saved = run.uninterrupted[k - 1][2]
    problems = logprob_problems(
        run.restored, lengths, saved, logprob_atol, what="the resumed policy's logprobs vs the saved policy's"
    )
    later = run.uninterrupted[k:]
    if float((later[-1][2] - saved).abs().max()) < 1e-4:
        problems.append("the steps after the checkpoint did not change the logprobs: the comparison is vacuous")
    for n, (expected, got) in enumerate(zip(later, run.resumed), start=k + 1):
        for what, a, b in (("loss", expected[0], got[0]), ("grad norm", expected[1], got[1])):
            if abs(a - b) > exact_atol + exact_rtol * abs(a):
                problems.append(f"step {n} {what}: resumed {b:.9g}, uninterrupted {a:.9g}")
        problems += logprob_problems(
            got[2],
            lengths,
            expected[2],
            exact_atol,
            what=f"logprobs after step {n}, resumed vs uninterrupted (adapters or "
            "optimizer state not restored exactly?)",
        )
    return problems
