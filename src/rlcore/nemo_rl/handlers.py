"""The ``custom`` rules of the mapping table: conversions that read several NeMo-RL keys at once.

Each handler takes the resolved NeMo-RL dict and the :class:`Conversion` being
built, and writes rlcore values (with their source paths), ignored keys or
problems. A handler tolerates the keys it reads being absent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlcore.config.messages import show_value
from rlcore.nemo_rl.conversion import Conversion, algorithm, get, is_neutral, put
from rlcore.nemo_rl.data_plane import data_plane, kv_recompute
from rlcore.nemo_rl.distillation import distillation_settings
from rlcore.nemo_rl.dpo import dpo_data, dpo_defaults
from rlcore.nemo_rl.sft import sft_data, sft_defaults
from rlcore.nemo_rl.tasks import checkpoint_metric, task
from rlcore.nemo_rl.vlm import automodel, is_vlm_run

_MISSING = object()
G = "policy.generation."


def _set(out: Conversion, target: str, value: Any, source: str) -> None:
    put(out.config, target, value)
    out.sources[target] = source


def _backend(nemo: dict[str, Any]) -> str:
    if get(nemo, "policy.megatron_cfg.enabled") is True:
        return "megatron"
    if get(nemo, "policy.dtensor_cfg.enabled", True) is True:
        return "dtensor"
    return "fsdp1"


def cluster(nemo: dict[str, Any], out: Conversion) -> None:
    """``cluster.gpus_per_node`` / ``num_nodes`` and the non-colocated generation resources.

    NeMo-RL's cluster is every GPU of the run; rlcore's is the training ranks, with generation's own
    resources under ``policy.generation.colocated.resources``: split the way NeMo-RL's GRPO setup does.
    """
    gpus, nodes = get(nemo, "cluster.gpus_per_node"), get(nemo, "cluster.num_nodes", 1)
    gen = get(nemo, "policy.generation")
    res_path = G + "colocated.resources"
    res = get(nemo, res_path) or {}
    colocated = not isinstance(gen, dict) or get(nemo, G + "colocated.enabled", True) is not False
    if gpus is None:
        return
    _set(out, "cluster.use_gpu", True, "cluster.gpus_per_node")
    if colocated:
        _set(out, "cluster.num_nodes", nodes, "cluster.num_nodes")
        _set(out, "cluster.workers_per_node", gpus, "cluster.gpus_per_node")
        if any(v is not None for v in res.values()):
            out.ignored.append((res_path, "only used when policy.generation.colocated.enabled is false"))
        return
    inf_gpus, inf_nodes = res.get("gpus_per_node"), res.get("num_nodes")
    if nodes == 1:
        if not isinstance(inf_gpus, int) or inf_gpus <= 0:
            out.problems.append(
                f"{res_path}.gpus_per_node: is {show_value(inf_gpus)}; with cluster.num_nodes 1 and "
                "generation not colocated it must be the number of GPUs for generation (> 0)"
            )
            return
        if inf_nodes not in (None, 1):
            out.problems.append(
                f"{res_path}.num_nodes: is {show_value(inf_nodes)}; with cluster.num_nodes 1 it must be 1 or null"
            )
        train = gpus - inf_gpus
        if train <= 0:
            out.problems.append(
                f"cluster.gpus_per_node: {gpus} minus {res_path}.gpus_per_node {inf_gpus} leaves no GPU for training"
            )
            return
        _set(out, "cluster.num_nodes", 1, "cluster.num_nodes")
        _set(out, "cluster.workers_per_node", train, f"cluster.gpus_per_node - {res_path}.gpus_per_node")
        _set(out, res_path, {"num_nodes": 1, "workers_per_node": inf_gpus}, res_path)
        return
    if not isinstance(inf_nodes, int) or inf_nodes <= 0:
        out.problems.append(
            f"{res_path}.num_nodes: is {show_value(inf_nodes)}; with several nodes and generation "
            "not colocated it must be the number of generation nodes (> 0)"
        )
        return
    if inf_gpus != gpus:
        out.problems.append(
            f"{res_path}.gpus_per_node: is {show_value(inf_gpus)}; with several nodes it must "
            f"equal cluster.gpus_per_node ({gpus})"
        )
    if nodes - inf_nodes <= 0:
        out.problems.append(
            f"cluster.num_nodes: {nodes} minus {res_path}.num_nodes {inf_nodes} leaves no node for training"
        )
        return
    _set(out, "cluster.num_nodes", nodes - inf_nodes, f"cluster.num_nodes - {res_path}.num_nodes")
    _set(out, "cluster.workers_per_node", gpus, "cluster.gpus_per_node")
    _set(out, res_path, {"num_nodes": inf_nodes, "workers_per_node": gpus}, res_path)


def chat_template(nemo: dict[str, Any], out: Conversion) -> None:
    """Same values and meaning; a NeMo-RL tokenizer section without the key means the tokenizer's own."""
    tok = get(nemo, "policy.tokenizer")
    if not isinstance(tok, dict):
        return
    if is_vlm_run(nemo):  # NeMo-RL renders with the processor, whose own template its get_tokenizer leaves be
        _set(out, "policy.tokenizer.chat_template", "default", "policy.tokenizer (a VLM run: the model's own)")
        if "chat_template" in tok:
            out.ignored.append(
                (
                    "policy.tokenizer.chat_template",
                    "a VLM run renders its prompts with the model's processor, whose own template NeMo-RL keeps "
                    "(get_tokenizer sets the configured one on the processor only when it has none): rlcore "
                    "writes 'default'",
                )
            )
        return
    if "chat_template" in tok:
        _set(out, "policy.tokenizer.chat_template", tok["chat_template"], "policy.tokenizer.chat_template")
    else:
        _set(out, "policy.tokenizer.chat_template", "default", "policy.tokenizer (no chat_template key)")


def clipping(nemo: dict[str, Any], out: Conversion) -> None:
    """NeMo-RL's megatron worker clips by ``megatron_cfg.optimizer.clip_grad``; the others by ``max_grad_norm``."""
    norm = get(nemo, "policy.max_grad_norm", _MISSING)
    if _backend(nemo) == "megatron":
        clip = get(nemo, "policy.megatron_cfg.optimizer.clip_grad", _MISSING)
        if clip is not _MISSING:
            value = None if clip is None or clip == 0 else clip
            _set(out, "policy.max_grad_norm", value, "policy.megatron_cfg.optimizer.clip_grad")
            if norm is not _MISSING and norm != value:
                out.ignored.append(
                    ("policy.max_grad_norm", "the megatron backend clips by megatron_cfg.optimizer.clip_grad")
                )
            return
    if norm is not _MISSING:
        _set(out, "policy.max_grad_norm", norm, "policy.max_grad_norm")


def optimizer(nemo: dict[str, Any], out: Conversion) -> None:
    opt = get(nemo, "policy.optimizer", _MISSING)
    if opt is None:
        why = (
            "the megatron backend uses megatron_cfg.optimizer"
            if _backend(nemo) == "megatron"
            else "null: rlcore's default optimizer (torch.optim.AdamW) is used"
        )
        out.ignored.append(("policy.optimizer", why))
    elif isinstance(opt, dict) and _backend(nemo) == "megatron":
        out.ignored.append(("policy.optimizer", "the megatron backend uses megatron_cfg.optimizer (as in NeMo-RL)"))
    elif isinstance(opt, dict):
        for key, value in opt.items():
            if key in ("name", "kwargs"):
                _set(out, f"policy.optimizer.{key}", value, f"policy.optimizer.{key}")
            else:
                out.problems.append(f"policy.optimizer.{key}: unknown key (a NeMo-RL optimizer has name and kwargs)")
        lr = (opt.get("kwargs") or {}).get("lr") if isinstance(opt.get("kwargs"), dict) else None
        if lr is not None:
            _set(out, "policy.learning_rate", lr, "policy.optimizer.kwargs.lr")
            return
    mlr = get(nemo, "policy.megatron_cfg.optimizer.lr")
    if _backend(nemo) == "megatron" and mlr is not None:
        _set(out, "policy.learning_rate", mlr, "policy.megatron_cfg.optimizer.lr")


def scheduler(nemo: dict[str, Any], out: Conversion) -> None:
    sched = get(nemo, "policy.scheduler", _MISSING)
    if sched is _MISSING:
        return
    if _backend(nemo) == "megatron":
        if sched is not None:
            out.ignored.append(("policy.scheduler", "the megatron backend uses megatron_cfg.scheduler (as in NeMo-RL)"))
        return
    if sched is None:
        _set(out, "policy.scheduler", None, "policy.scheduler")
        return
    entries = sched if isinstance(sched, list) else [sched]
    converted = []
    for entry in entries:
        if isinstance(entry, dict) and "milestones" in entry and "name" not in entry:
            converted.append({"name": "milestones", **entry})
        else:
            converted.append(entry)
    _set(out, "policy.scheduler", converted, "policy.scheduler")


def advantage(nemo: dict[str, Any], out: Conversion) -> None:
    """``adv_estimator.name`` grpo: ``use_leave_one_out_baseline`` × ``normalize_rewards`` →
    ``grpo.advantage_estimator``; gdpo: those and ``reward_weights`` → ``grpo.gdpo``; reinforce_plus_plus:
    ``minus_baseline`` → ``reinforce_plus_plus[_baseline]``."""
    grpo = nemo.get("grpo")
    if not isinstance(grpo, dict):
        return
    est = grpo.get("adv_estimator") if isinstance(grpo.get("adv_estimator"), dict) else {}
    name = est.get("name", "grpo")
    if name not in ("grpo", "gdpo", "reinforce_plus_plus"):
        out.problems.append(
            f"grpo.adv_estimator.name: is {show_value(name)}, but rlcore does not support that "
            "advantage estimator: set it to 'grpo', 'gdpo' or 'reinforce_plus_plus'"
        )
        return
    own = {
        "grpo": ("normalize_rewards", "use_leave_one_out_baseline"),
        "gdpo": ("normalize_rewards", "use_leave_one_out_baseline", "reward_weights"),
        "reinforce_plus_plus": ("minus_baseline",),
    }
    for key, value in est.items():
        if key == "name" or key in own[name]:
            continue
        owner = next((n for n, keys in own.items() if key in keys), None)
        if owner is not None:
            if value is not None:
                out.ignored.append((f"grpo.adv_estimator.{key}", f"{owner} only"))
        elif not is_neutral(value, (None, False)):
            out.problems.append(
                f"grpo.adv_estimator.{key}: is {show_value(value)}, an option rlcore's reader does not know: remove it"
            )
    if name == "reinforce_plus_plus":
        baseline = est.get("minus_baseline", True) is not False  # NeMo-RL's examples set it true
        _set(
            out,
            "grpo.advantage_estimator",
            "reinforce_plus_plus_baseline" if baseline else "reinforce_plus_plus",
            "grpo.adv_estimator.name, grpo.adv_estimator.minus_baseline",
        )
        out.ignored.extend((f"grpo.{key}", "grpo advantages only") for key in own["grpo"] if key in grpo)
        return
    loo_path = (
        "grpo.adv_estimator.use_leave_one_out_baseline"
        if "use_leave_one_out_baseline" in est
        else "grpo.use_leave_one_out_baseline"
    )
    norm_path = "grpo.adv_estimator.normalize_rewards" if "normalize_rewards" in est else "grpo.normalize_rewards"
    loo, norm = get(nemo, loo_path, _MISSING), get(nemo, norm_path, _MISSING)
    if name == "gdpo":
        _gdpo(est, out, (loo is not False, loo_path), (norm is not False, norm_path))  # NeMo-RL's defaults: true
        return
    if loo is _MISSING and norm is _MISSING:
        return
    loo, norm = loo is not False, norm is not False  # NeMo-RL's defaults are true
    estimator = {
        (True, True): "leave_one_out_std",
        (True, False): "leave_one_out",
        (False, True): "mean_std",
        (False, False): "mean",
    }[(loo, norm)]
    _set(out, "grpo.advantage_estimator", estimator, f"{loo_path}, {norm_path}")


def _gdpo(est: dict[str, Any], out: Conversion, loo: tuple[bool, str], norm: tuple[bool, str]) -> None:
    _set(out, "grpo.advantage_estimator", "gdpo", "grpo.adv_estimator.name")
    _set(out, "grpo.gdpo.use_leave_one_out_baseline", *loo)
    _set(out, "grpo.gdpo.normalize_rewards", *norm)
    if est.get("reward_weights") is not None:
        _set(out, "grpo.gdpo.reward_weights", est["reward_weights"], "grpo.adv_estimator.reward_weights")


def importance_sampling(nemo: dict[str, Any], out: Conversion) -> None:
    loss = nemo.get("loss_fn")
    if not isinstance(loss, dict):
        return
    on = loss.get("use_importance_sampling_correction", False)
    if "use_importance_sampling_correction" in loss:
        _set(out, "loss.use_importance_sampling_correction", on, "loss_fn.use_importance_sampling_correction")
    keys = (
        "truncated_importance_sampling_type",
        "truncated_importance_sampling_ratio",
        "truncated_importance_sampling_ratio_min",
    )
    for key in keys:
        if key not in loss:
            continue
        value, path = loss[key], f"loss_fn.{key}"
        if on is not True:
            if value is not None:
                out.ignored.append((path, "only used with loss_fn.use_importance_sampling_correction"))
        elif key == "truncated_importance_sampling_type" and value is None:
            continue  # NeMo-RL's null type is 'tis', rlcore's default
        else:
            _set(out, f"loss.{key}", value, path)


def loss_defaults(nemo: dict[str, Any], out: Conversion) -> None:
    """NeMo-RL builds its loss config with its own defaults; the one that differs from rlcore's is the KL
    coefficient (0.01 there, 0 here), so a GRPO or PPO loss_fn section without it keeps NeMo-RL's."""
    loss = nemo.get("loss_fn")
    if algorithm(nemo) in ("grpo", "ppo") and isinstance(loss, dict) and "reference_policy_kl_penalty" not in loss:
        _set(out, "loss.reference_policy_kl_penalty", 0.01, "loss_fn (NeMo-RL's default reference_policy_kl_penalty)")


HANDLERS: dict[str, Callable[[dict[str, Any], Conversion], None]] = {
    "cluster": cluster,
    "chat_template": chat_template,
    "clipping": clipping,
    "optimizer": optimizer,
    "scheduler": scheduler,
    "advantage": advantage,
    "importance_sampling": importance_sampling,
    "loss_defaults": loss_defaults,
    "task": task,
    "checkpoint_metric": checkpoint_metric,
    "sft_data": sft_data,
    "sft_defaults": sft_defaults,
    "dpo_data": dpo_data,
    "dpo_defaults": dpo_defaults,
    "distillation_settings": distillation_settings,
    "data_plane": data_plane,
    "kv_recompute": kv_recompute,
    "automodel": automodel,
}
ORDER = tuple(HANDLERS)

__all__ = ["HANDLERS", "ORDER"]
