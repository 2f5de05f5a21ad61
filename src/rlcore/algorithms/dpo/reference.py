"""The frozen reference policy's logprobs of DPO batches, computed ahead for several batches per weight swap.

Each call of ``policy.get_reference_policy_logprobs`` swaps the reference weights in and the trained ones back
(three copies of the model's state: snapshot, load, restore). Computing them step by step cost about a quarter
of a small model's DPO step, so :class:`ReferenceLogprobs` encodes the next ``dpo.reference_batches_per_swap``
training batches (the data source draws a batch by its index, without moving the run's position), computes
their reference logprobs in one call, and hands each step its own rows. The reference weights never change
during a run, so a value stays right for the whole run; the cache lives in the process (a resumed run
recomputes from where it resumes) and a batch's entry is dropped once its step has taken it. Validation
batches are fixed, so theirs are computed in one call at the first validation and kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlcore.data import BatchedDataDict
    from rlcore.run.build import Run


def reference_logprobs(policy: Any, batches: list[BatchedDataDict]) -> list[Any]:
    """The reference logprobs of each of ``batches`` (rows x its own width), from one call: one weight swap."""
    from rlcore.data import BatchedDataDict

    policy.prepare_for_lp_inference()
    # token logprobs need no pairing: any micro-batch plan will do; narrower batches are right-padded, which
    # leaves a causal model's logprobs of their tokens as they are
    rows = BatchedDataDict.from_batches(
        [{k: b[k] for k in ("input_ids", "input_lengths", "token_mask", "sample_mask")} for b in batches]
    )
    values = policy.get_reference_policy_logprobs(rows)["reference_logprobs"]
    out, begin = [], 0
    for b in batches:
        size, width = b["input_ids"].shape
        out.append(values[begin : begin + size, :width].clone())
        begin += size
    return out


class ReferenceLogprobs:
    """Reference logprobs of a run's training batches (by batch index) and validation batches (by position)."""

    def __init__(self, run: Run, batches_per_swap: int) -> None:
        self.run, self.batches_per_swap = run, batches_per_swap
        self.train: dict[int, tuple[Any, Any]] = {}  # batch index -> (input_ids, reference logprobs)
        self.validation: dict[int, Any] = {}

    def for_train_batch(self, index: int, batch: BatchedDataDict) -> Any:
        """``batch``'s (the run's training batch ``index``) reference logprobs, computing those of the next
        ``batches_per_swap`` batches in one swap when it has none."""
        if index not in self.train:
            self.train.clear()
            indices, batches = [index], [batch]
            last = min(index + self.batches_per_swap, self.run.num_steps)  # DPO's step i draws batch i
            for ahead in range(index + 1, last):
                encoded = self._encoded(ahead)
                if encoded is None:
                    break
                indices.append(ahead)
                batches.append(encoded)
            for i, b, values in zip(indices, batches, reference_logprobs(self.run.policy, batches)):
                self.train[i] = (b["input_ids"], values)
        input_ids, values = self.train.pop(index)
        if not (input_ids.shape == batch["input_ids"].shape and bool((input_ids == batch["input_ids"]).all())):
            raise RuntimeError(
                f"DPO reference logprobs: training batch {index} was encoded differently when its "
                "reference logprobs were computed ahead (a data source that is not deterministic "
                "by batch index?)"
            )
        return values

    def _encoded(self, index: int) -> BatchedDataDict | None:
        """Training batch ``index`` encoded as its step will encode it, or None past the data's end."""
        from rlcore.algorithms.dpo.batches import dpo_batch
        from rlcore.datasets import DataExhausted

        try:
            samples = self.run.data.train.batch(index)
        except DataExhausted:
            return None
        return dpo_batch(samples, self.run.tokenizer, self.run.cfg)

    def for_validation(self, batches: list[BatchedDataDict]) -> list[Any]:
        """The reference logprobs of the validation batches, all computed in one swap the first time."""
        if len(self.validation) != len(batches):
            self.validation = dict(enumerate(reference_logprobs(self.run.policy, batches)))
        return [self.validation[i] for i in range(len(batches))]
