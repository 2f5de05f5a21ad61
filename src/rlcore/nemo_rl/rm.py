"""NeMo-RL's reward-model configs as rlcore's: an ``rm`` section without a ``grpo`` one is a reward-model run.

NeMo-RL's RM (``examples/run_rm.py``, ``nemo_rl/algorithms/rm.py``) reads ``rm``, ``policy`` (with
``reward_model_cfg``), ``data``, ``checkpointing``, ``logger`` and ``cluster``. The ``rm`` keys keep their names and
defaults (:class:`rlcore.algorithms.rm.config.RMConfig`; ``max_num_steps: -1`` trains the epochs, ``val_batches: -1``
is rlcore's 0, every validation pair). ``policy.reward_model_cfg`` with ``enabled: true`` and ``reward_model_type:
bradley_terry`` is what rlcore's ``rm`` does (the policy built as a value model, the Bradley-Terry loss on the score at
each sequence's last token); any other type is refused in one line. The data is read as a DPO config's
(:mod:`rlcore.nemo_rl.dpo`: PreferenceDataset's and BinaryPreferenceDataset's rows, HelpSteer3 and the other hub
names), tokenized with BOS and EOS and without a generation prompt (NeMo-RL's preference preprocessor), and
``checkpointing.metric_name`` ``val:validation-<set>_<metric>`` becomes ``validation/<metric>``.

All of it is read before the table is walked (:func:`own_sections`), and ``data``, ``policy.reward_model_cfg`` and
the checkpoint metric are taken out of what the walker and the GRPO handlers see.
"""

from __future__ import annotations

from typing import Any

from rlcore.config.messages import show_value
from rlcore.nemo_rl.conversion import Conversion, algorithm, get, put, without_unread
from rlcore.nemo_rl.dpo import TOKENIZATION, _PreferenceData

#: The sections of a NeMo-RL config its RM does not read, with why.
UNREAD = {
    "loss_fn": "NeMo-RL's RM trains its own loss (Bradley-Terry); it does not read the policy-gradient loss",
    "env": "NeMo-RL's RM scores nothing; it does not read the environments",
    "policy.generation": "NeMo-RL's RM generates nothing; it does not read the generation settings",
}
#: NeMo-RL's RM validation metrics (RMValMetrics) that rlcore's RM validation logs, by rlcore's name.
METRICS = {
    "loss": "loss",
    "accuracy": "accuracy",
    "rewards_chosen_mean": "rewards_chosen_mean",
    "rewards_rejected_mean": "rewards_rejected_mean",
}


def _reward_model(nemo: dict[str, Any], out: Conversion) -> None:
    head = get(nemo, "policy.reward_model_cfg")
    if head is None:
        return
    if isinstance(head, dict) and head.get("enabled") is True and head.get("reward_model_type") == "bradley_terry":
        out.ignored.append(
            (
                "policy.reward_model_cfg",
                "rlcore's rm builds the policy as a value model and trains it with the Bradley-Terry loss (what "
                "enabled: true, reward_model_type: bradley_terry does)",
            )
        )
        return
    out.problems.append(
        f"policy.reward_model_cfg: is {show_value(head)}; rlcore trains Bradley-Terry reward models only: set "
        "enabled: true and reward_model_type: bradley_terry"
    )


def _checkpoint_metric(nemo: dict[str, Any], out: Conversion) -> None:
    ck = nemo.get("checkpointing")
    if not isinstance(ck, dict) or ck.get("metric_name") is None:
        return
    name = ck["metric_name"]
    paths = get(nemo, "data.val_data_paths")
    sets = list(paths) if isinstance(paths, dict) and paths else ["default"]
    known = {f"val:validation-{s}_{m}": f"validation/{ours}" for s in sets for m, ours in METRICS.items()}
    if name not in known:
        out.problems.append(
            f"checkpointing.metric_name: is {show_value(name)}; rlcore ranks reward-model checkpoints by "
            f"{', '.join(known)} (or, after converting, any metric of metrics.jsonl), or null keeps the newest"
        )
        return
    put(out.config, "checkpointing.metric_name", known[name])
    out.sources["checkpointing.metric_name"] = "checkpointing.metric_name"
    if "higher_is_better" in ck:
        put(out.config, "checkpointing.higher_is_better", ck["higher_is_better"])
        out.sources["checkpointing.higher_is_better"] = "checkpointing.higher_is_better"


def own_sections(nemo: dict[str, Any], out: Conversion) -> dict[str, Any]:
    """A reward-model config's own reading (see the module's docstring): ``nemo`` without the sections NeMo-RL's RM
    does not read (listed as ignored) and without those converted here."""
    if algorithm(nemo) != "rm":
        return nemo
    kept = without_unread(nemo, out, UNREAD)
    _reward_model(kept, out)
    _checkpoint_metric(kept, out)
    data = kept.get("data")
    if isinstance(data, dict):
        _PreferenceData(kept, out).read(data)
    for key, value in TOKENIZATION.items():
        put(out.config, f"rm.{key}", value)
        out.sources[f"rm.{key}"] = "rm (NeMo-RL's RM tokenizes with BOS and EOS, without a generation prompt)"
    kept = {k: v for k, v in kept.items() if k != "data"}
    if isinstance(kept.get("policy"), dict):
        kept["policy"] = {k: v for k, v in kept["policy"].items() if k != "reward_model_cfg"}
    if isinstance(kept.get("checkpointing"), dict):
        kept["checkpointing"] = {
            k: v for k, v in kept["checkpointing"].items() if k not in ("metric_name", "higher_is_better")
        }
    return kept


__all__ = ["own_sections"]
