"""NeMo-RL's ``env.reward_model`` section (``grpo_rm_1B.yaml``) as rlcore's ``env.reward_model_cfg``.

NeMo-RL's reward-model environment builds a Policy of the section itself, so the section is a policy section plus
the environment's keys: ``model_name``, ``checkpoint_path``, ``batch_size``, ``precision`` and ``max_model_len`` keep
their names; ``resources {gpus_per_node, num_nodes}`` become ``resources {workers_per_node, num_nodes}``; the
policy keys (``tokenizer``, ``dtensor_cfg`` ...) are converted as ``policy`` is (the table's walker) into
``env.reward_model_cfg.policy``. What NeMo-RL's environment asserts is refused the same way here (a type other than
``bradley_terry``, ``dynamic_batching`` or ``sequence_packing`` on, a ``max_grad_norm``, ``dtensor_cfg`` off or with
``cpu_offload`` / ``activation_checkpointing``). The reward model's GPUs are not the policy's: on one node they come
off ``cluster.gpus_per_node``, on several its nodes off ``cluster.num_nodes``, as NeMo-RL's GRPO setup splits them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlcore.config.messages import show_value
from rlcore.nemo_rl.conversion import Conversion, put
from rlcore.nemo_rl.second_policy import leaves, source

NEMO = "env.reward_model"
TARGET = "env.reward_model_cfg"
#: Keys that keep their name.
SAME = ("model_name", "checkpoint_path", "batch_size", "precision", "max_model_len")
#: Keys that change nothing here, with why.
IGNORED = {
    "enabled": "the data's env_name selects the environment",
    "processor": "the data entry's processor builds the prompts; NeMo-RL's reward-model environment does not read it",
    "logprob_batch_size": "NeMo-RL's scorer reads batch_size (env.reward_model_cfg.batch_size)",
    "offload_optimizer_for_logprob": "the reward model has no optimizer",
}
#: NeMo-RL's assertions (nemo_rl/environments/reward_model_environment.py): path -> (the values it allows, why).
MUST = {
    "dynamic_batching.enabled": ((False, None), "the reward model scores padded batches"),
    "sequence_packing.enabled": ((False, None), "the reward model scores padded batches"),
    "max_grad_norm": ((None,), "the reward model does not train"),
    "dtensor_cfg.enabled": ((True, None), "NeMo-RL's reward model runs on DTensor only"),
    "dtensor_cfg.cpu_offload": ((False, None), "NeMo-RL's reward-model environment refuses it"),
    "dtensor_cfg.activation_checkpointing": ((False, None), "NeMo-RL's reward-model environment refuses it"),
}


def _set(out: Conversion, target: str, value: Any, nemo_key: str) -> None:
    put(out.config, target, value)
    out.sources[target] = nemo_key


def reward_model_settings(settings: dict[str, Any], nemo: dict[str, Any], out: Conversion) -> None:
    """``env.reward_model`` → ``env.reward_model_cfg`` (see the module's docstring)."""
    rest = dict(settings)
    for key in SAME:
        if key in rest and (value := rest.pop(key)) is not None:
            _set(out, f"{TARGET}.{key}", value, f"{NEMO}.{key}")
    for key, why in IGNORED.items():
        if key in rest:
            rest.pop(key)
            out.ignored.append((f"{NEMO}.{key}", why))
    _reward_model_type(rest.pop("reward_model_cfg", None), out)
    _resources(rest.pop("resources", None), nemo, out)
    if (generation := rest.pop("generation", None)) is not None:
        out.problems.append(
            f"{NEMO}.generation: is {show_value(generation)}; the reward model scores, it does not generate (NeMo-RL "
            "would divide its scores by the generation temperature): remove it"
        )
    for path, (allowed, why) in MUST.items():
        value = _get(rest, path)
        if value is not _ABSENT and value not in allowed:
            out.problems.append(
                f"{NEMO}.{path}: is {show_value(value)}; {why}: set it to {show_value(allowed[0])} or remove it"
            )
        elif value is not _ABSENT and not path.startswith("dtensor_cfg."):
            out.ignored.append((f"{NEMO}.{path}", f"{show_value(value)}: off, as rlcore's reward model always is"))


_ABSENT = object()


def _get(section: dict[str, Any], path: str) -> Any:
    """The value at the dotted ``path`` of ``section`` (``_ABSENT`` when there is none)."""
    node: Any = section
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return _ABSENT
        node = node[key]
    return node


def _reward_model_type(head: Any, out: Conversion) -> None:
    path = f"{NEMO}.reward_model_cfg"
    if isinstance(head, dict) and head.get("enabled") is True and head.get("reward_model_type") == "bradley_terry":
        out.ignored.append((path, "a Bradley-Terry reward model: its score at the last token is the reward, as here"))
        return
    out.problems.append(
        f"{path}: is {show_value(head)}; the reward-model environment scores with a Bradley-Terry reward model (the "
        "score at the last token): set enabled: true and reward_model_type: bradley_terry"
    )


def _resources(res: Any, nemo: dict[str, Any], out: Conversion) -> None:
    """The reward model's workers, and the run's cluster without them (NeMo-RL's split)."""
    path = f"{NEMO}.resources"
    if not isinstance(res, dict):
        out.problems.append(f"{path}: is {show_value(res)}; give the reward model's {{gpus_per_node, num_nodes}}")
        return
    gpus, nodes = res.get("gpus_per_node", 1), res.get("num_nodes", 1)
    if not isinstance(gpus, int) or gpus < 1 or not isinstance(nodes, int) or nodes < 1:
        out.problems.append(f"{path}: is {show_value(res)}; set gpus_per_node and num_nodes to counts of at least 1")
        return
    _set(out, f"{TARGET}.resources.workers_per_node", gpus, f"{path}.gpus_per_node")
    _set(out, f"{TARGET}.resources.num_nodes", nodes, f"{path}.num_nodes")
    for key in sorted(set(res) - {"gpus_per_node", "num_nodes"}):
        out.ignored.append((f"{path}.{key}", "the reward model's workers are gpus_per_node x num_nodes"))
    cluster = out.config.get("cluster", {})
    total_nodes = (nemo.get("cluster") or {}).get("num_nodes", 1)
    if "workers_per_node" not in cluster:
        return  # no cluster.gpus_per_node: nothing to split
    key, reserved, nemo_key, what = (
        ("workers_per_node", gpus, "gpus_per_node", "GPU")
        if total_nodes == 1
        else ("num_nodes", nodes, "num_nodes", "node")
    )
    left = cluster[key] - reserved
    if left < 1:
        out.problems.append(
            f"{path}: the reward model's {reserved} {what}s leave no {what} of cluster.{nemo_key} ({cluster[key]}) "
            f"for the policy: raise cluster.{nemo_key} or lower {path}.{nemo_key}"
        )
        return
    _set(out, f"cluster.{key}", left, f"{out.sources.get(f'cluster.{key}', 'cluster')} - {path}")


def policy_keys(nemo: dict[str, Any], out: Conversion, convert: Callable[[dict[str, Any]], Conversion]) -> None:
    """After the table's walk, when the data's environment is the reward model: the section's keys
    :func:`reward_model_settings` leaves converted as a policy section into ``env.reward_model_cfg.policy``.
    ``convert``: the table's walker (:func:`rlcore.nemo_rl.convert.convert`, passed in: it imports this module)."""
    if "reward_model_cfg" not in (out.config.get("env") or {}):
        return
    section = (nemo.get("env") or {}).get("reward_model") or {}
    handled = {*SAME, *IGNORED, "reward_model_cfg", "resources", "generation"}
    rest = {key: value for key, value in section.items() if key not in handled}
    if not rest:
        return
    converted = convert({"policy": rest})
    out.problems.extend(_renamed(line) for line in converted.problems)
    out.ignored.extend((_renamed(path), why) for path, why in converted.ignored)
    for path, value in leaves(converted.config.get("policy", {}), "policy").items():
        if path in ("policy.dynamic_batching.enabled", "policy.sequence_packing.enabled", "policy.max_grad_norm"):
            continue  # checked above: off, as the reward model always is
        target = f"{TARGET}.policy.{path[len('policy.') :]}"
        put(out.config, target, value)
        out.sources[target] = _renamed(source(converted.sources, path))


def _renamed(text: str) -> str:
    return NEMO + text[len("policy") :] if text.startswith("policy") else text


__all__ = ["policy_keys", "reward_model_settings"]
