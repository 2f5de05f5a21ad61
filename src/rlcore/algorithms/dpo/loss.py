"""DPO: the loss over (chosen, rejected) pairs, with an optional SFT term on the chosen responses.

A DPO batch interleaves pairs: row ``2i`` is a chosen response and row
``2i+1`` the rejected response to the same prompt (NeMo-RL's layout). The loss
of a pair needs both rows' summed logprobs, so both rows must be in the same
micro-batch: the caller marks the batch with ``batch.group_size = 2`` and
:meth:`rlcore.data.BatchedDataDict.shard_by_batch_size` then keeps every pair
on one rank, in one step and in one micro-batch (plain, dynamic batching and
packing alike). The loss checks what it can and raises rather than pair up the
wrong rows.

Normalisation (the contract of :mod:`rlcore.interfaces.loss`): the loss is a
mean over the *valid pairs of the whole step*, ``global_valid_seqs / 2``. A
pair is valid when its rows have ``sample_mask`` 1; the two rows of a pair
must agree (a micro-batch where they differ is an error), so that count is
exact. Every term and metric is this micro-batch's share, summed over
micro-batches and dp ranks by the caller.

Importing this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from rlcore.algorithms.dpo.config import DPOLossConfig
from rlcore.algorithms.utils import masked_input, normaliser, valid_token_mask, zero_off_mask
from rlcore.interfaces.loss import LossType

if TYPE_CHECKING:
    import torch

__all__ = ["DPOLossConfig", "DPOLossFn", "check_pairs"]


class DPOLossFn:
    """Direct Preference Optimization (Rafailov et al., 2023), NeMo-RL's ``DPOLossFn`` semantics.

    Per pair, with ``r = sum_t (log pi - log pi_ref)`` over a response's valid tokens (the mean with
    ``preference_average_log_probs``) and beta = ``reference_policy_kl_penalty``::

        preference = -log sigmoid(beta * (r_chosen - r_rejected))
        sft        = -sum_t log pi(chosen)          (the mean with sft_average_log_probs)
        loss       = preference_loss_weight * preference + sft_loss_weight * sft

    each averaged over the step's valid pairs (module docstring). The SFT term is, as in NeMo-RL, a
    per-pair (sequence-level) mean, not a mean over tokens. Reference-free DPO is not offered:
    ``data['reference_policy_logprobs']`` is required.

    Metrics, each this micro-batch's share of the step's mean over valid pairs: ``loss``,
    ``preference_loss``, ``sft_loss`` (0 when ``sft_loss_weight`` is 0, as in NeMo-RL), ``accuracy``
    (fraction of pairs with ``r_chosen > r_rejected``), ``rewards_chosen_mean``,
    ``rewards_rejected_mean`` and ``rewards_margin_mean`` (``r_chosen - r_rejected``). The rewards are
    NeMo-RL's: the log-ratios *without* beta (DPO's implicit reward is beta times them). And
    ``num_valid_samples``: this micro-batch's number of valid pairs, a raw count.

    Checks (:func:`check_pairs`): an even number of rows, equal ``sample_mask`` within a pair and,
    where the micro-batch says which rows it holds (``pair_ids``, or ``sample_indices`` metadata that
    sharding records), that rows ``2i`` / ``2i+1`` really are one pair.
    """

    loss_type = LossType.SEQUENCE_LEVEL

    def __init__(self, cfg: DPOLossConfig | BaseModel | Mapping[str, Any] | None = None) -> None:
        """``cfg``: a :class:`DPOLossConfig`, or the same fields as a mapping or another config model (the
        run's ``dpo`` section keeps its own copy), validated here."""
        if cfg is None:
            cfg = DPOLossConfig()
        elif not isinstance(cfg, DPOLossConfig):
            from rlcore.config import ConfigError, validate_section

            if isinstance(cfg, BaseModel):
                cfg = cfg.model_dump()

            model, problems = validate_section(DPOLossConfig, cfg, "dpo")
            if model is None:
                raise ConfigError(problems)
            cfg = model
        self.cfg = cfg

    def __call__(
        self,
        logprobs: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        import torch

        cfg = self.cfg
        mask = valid_token_mask(data, logprobs.device)
        valid_pair = check_pairs(data, mask)
        lp = zero_off_mask(logprobs, mask)
        ref = masked_input(data, "reference_policy_logprobs", mask, lp)
        if ref is None:
            raise KeyError(
                "DPOLossFn needs data['reference_policy_logprobs'] (reference-free DPO is not offered); "
                "compute them with Policy.get_reference_policy_logprobs before training"
            )
        pair_weight = valid_pair.to(lp.dtype)
        pairs = normaliser(torch.as_tensor(global_valid_seqs, device=lp.device) / 2, lp)
        tokens = mask.sum(-1).clamp_min(1).to(lp.dtype)

        def pair_mean(per_pair: torch.Tensor) -> torch.Tensor:
            return (per_pair.to(lp.dtype) * pair_weight).sum() / pairs

        rewards = (lp - ref).sum(-1)
        if cfg.preference_average_log_probs:
            rewards = rewards / tokens
        chosen, rejected = rewards[0::2], rewards[1::2]
        margin = chosen - rejected
        preference = pair_mean(-torch.nn.functional.logsigmoid(cfg.reference_policy_kl_penalty * margin))
        loss = cfg.preference_loss_weight * preference
        sft = torch.zeros((), dtype=lp.dtype, device=lp.device)
        if cfg.sft_loss_weight > 0:
            nll = -lp.sum(-1)
            if cfg.sft_average_log_probs:
                nll = nll / tokens
            sft = pair_mean(nll[0::2])
            loss = loss + cfg.sft_loss_weight * sft

        with torch.no_grad():
            named = {
                "loss": loss,
                "sft_loss": sft,
                "preference_loss": preference,
                "accuracy": pair_mean(chosen > rejected),
                "rewards_chosen_mean": pair_mean(chosen),
                "rewards_rejected_mean": pair_mean(rejected),
                "rewards_margin_mean": pair_mean(margin),
                "num_valid_samples": pair_weight.sum(),
            }
            values = torch.stack([v.detach().to(torch.float64) for v in named.values()]).unbind()
        return loss, dict(zip(named, values))  # 0-dim float64 tensors: the training loop reads them once per step


def check_pairs(data: Mapping[str, Any], mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[B / 2]``: which (chosen, rejected) pairs of the micro-batch count; raises if its rows are not
    whole pairs.

    Rows ``2i`` and ``2i+1`` must be one pair: the row count must be even, their ``sample_mask`` equal,
    their ``pair_ids`` (an optional ``[B]`` data column) equal, and where the micro-batch carries
    ``sample_indices`` (what :meth:`~rlcore.data.BatchedDataDict.shard_by_batch_size` records: each
    row's index in the batch given to the policy) they must be rows ``2j`` and ``2j+1`` of that batch.
    The last check catches a batch sharded without ``group_size = 2`` under dynamic batching or
    packing, whose micro-batches hold rows sorted by length.
    """
    import torch

    rows = mask.shape[0]
    hint = (
        "a DPO batch interleaves (chosen, rejected) rows and must be marked with batch.group_size = 2 "
        "before Policy.train, so that every micro-batch holds whole pairs"
    )
    if rows % 2:
        raise ValueError(f"DPOLossFn: a micro-batch of {rows} rows is not whole (chosen, rejected) pairs; {hint}")
    sample_mask = data.get("sample_mask")
    keep = (
        torch.ones(rows, dtype=torch.bool, device=mask.device)
        if sample_mask is None
        else torch.as_tensor(sample_mask, device=mask.device) != 0
    )
    if bool((keep[0::2] != keep[1::2]).any()):
        bad = int((keep[0::2] != keep[1::2]).nonzero()[0, 0])
        raise ValueError(
            f"DPOLossFn: rows {2 * bad} and {2 * bad + 1} of a pair have different sample_mask; "
            "mask a pair as a whole (both rows 0 or both 1)"
        )
    pair_ids = data.get("pair_ids")
    if pair_ids is not None:
        ids = torch.as_tensor(pair_ids)
        differ = ids[0::2] != ids[1::2]
        if bool(differ.any()):
            bad = int(differ.nonzero()[0, 0])
            raise ValueError(
                f"DPOLossFn: rows {2 * bad} and {2 * bad + 1} have pair_ids {ids[2 * bad].item()} "
                f"and {ids[2 * bad + 1].item()}: not one pair; {hint}"
            )
    origin = getattr(data, "sample_indices", None)
    if origin is not None and len(origin) == rows:
        for i in range(0, rows, 2):
            if origin[i] % 2 or origin[i + 1] != origin[i] + 1:
                raise ValueError(
                    f"DPOLossFn: rows {i} and {i + 1} of this micro-batch are rows {origin[i]} and "
                    f"{origin[i + 1]} of the batch, not one (chosen, rejected) pair; {hint}"
                )
    return keep[0::2]
