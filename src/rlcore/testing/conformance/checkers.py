"""Pure checkers of backend outputs: each returns a list of problem lines, empty when the output conforms.

Public so that a backend can reuse them in its own tests. The step and weight
checkers (:func:`~rlcore.testing.oracle.step_problems`,
:func:`~rlcore.testing.oracle.weight_problems`) live beside the oracles in
:mod:`rlcore.testing.oracle`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def logprob_problems(
    logprobs: Any,
    input_lengths: torch.Tensor,
    expected: torch.Tensor | None = None,
    atol: float = 1e-5,
    what: str = "logprobs vs the single-process Hugging Face float32 forward",
) -> list[str]:
    """Problems with ``[B, S]`` token logprobs (design.md §2.2); empty when they conform.

    Float32, the shape of ``expected`` (if given), position 0 is 0, positions
    at or beyond a sequence's length are 0, and valid positions are within
    ``atol`` of ``expected``.
    """
    import torch

    if not isinstance(logprobs, torch.Tensor):
        return [f"{what}: expected a tensor, got {type(logprobs).__name__}"]
    problems = []
    if logprobs.dtype != torch.float32:
        problems.append(f"{what}: dtype {logprobs.dtype}, expected torch.float32")
    if expected is not None and tuple(logprobs.shape) != tuple(expected.shape):
        return problems + [f"{what}: shape {tuple(logprobs.shape)}, expected {tuple(expected.shape)}"]
    if logprobs.dim() != 2:
        return problems + [f"{what}: expected [B, S], got shape {tuple(logprobs.shape)}"]
    lp = logprobs.float()
    positions = torch.arange(lp.shape[1])[None, :]
    valid = positions < input_lengths[:, None]
    if (lp[:, 0] != 0).any():
        problems.append(f"{what}: position 0 must be 0, got {lp[:, 0].tolist()}")
    if (lp[~valid] != 0).any():
        rows = sorted({int(r) for r in (~valid & (lp != 0)).nonzero()[:, 0]})
        problems.append(f"{what}: padding positions must be 0 (non-zero in rows {rows})")
    if not torch.isfinite(lp).all():
        problems.append(f"{what}: non-finite values")
    if expected is not None:
        diff = (lp - expected.float()).abs() * valid
        worst = float(diff.max())
        if not worst <= atol:  # also catches NaN
            row, col = divmod(int(diff.argmax()), lp.shape[1])
            problems.append(
                f"{what}: differ from the expected values by {worst:.3g} (> {atol:g}) at row {row}, position {col}"
            )
    return problems


def generation_output_problems(
    input_ids: torch.Tensor, input_lengths: torch.Tensor, out: Any, max_new_tokens: int, pad_id: int
) -> list[str]:
    """Problems with a ``generate`` result (``GenerationOutputSpec``); empty when it conforms.

    ``output_ids`` is ``[B, S_prompt + max_new_tokens]``: each row is its
    prompt, then its generated tokens, then ``pad_id``;
    ``unpadded_sequence_lengths = input_lengths + generation_lengths``;
    ``logprobs`` has the shape of ``output_ids``, float32, 0 on prompt and
    padding positions and a finite value <= 0 on generated ones.
    """
    import torch

    keys = ("output_ids", "generation_lengths", "unpadded_sequence_lengths", "logprobs")
    if missing := [k for k in keys if k not in out]:
        return [f"generate output lacks {missing}"]
    ids, gen_lens, lens, lp = (out[k] for k in keys)
    batch, prompt_width = input_ids.shape
    problems = []
    if tuple(ids.shape) != (batch, prompt_width + max_new_tokens):
        return [f"output_ids shape {tuple(ids.shape)}, expected {(batch, prompt_width + max_new_tokens)}"]
    if tuple(lp.shape) != tuple(ids.shape):
        problems.append(f"logprobs shape {tuple(lp.shape)}, expected {tuple(ids.shape)}")
    if lp.dtype != torch.float32:
        problems.append(f"logprobs dtype {lp.dtype}, expected torch.float32")
    if ((gen_lens < 0) | (gen_lens > max_new_tokens)).any():
        problems.append(f"generation_lengths {gen_lens.tolist()} outside [0, {max_new_tokens}]")
    if not torch.equal(lens.long(), (input_lengths + gen_lens).long()):
        problems.append(
            f"unpadded_sequence_lengths {lens.tolist()} != input_lengths + generation_lengths "
            f"{(input_lengths + gen_lens).tolist()}"
        )
    if problems:
        return problems
    positions = torch.arange(ids.shape[1])[None, :]
    prompt = positions < input_lengths[:, None]
    generated = ~prompt & (positions < lens[:, None])
    padding = positions >= lens[:, None]
    width = ids.shape[1]
    prompt_in = torch.nn.functional.pad(input_ids, (0, width - prompt_width))
    if not torch.equal(ids[prompt], prompt_in[prompt]):
        problems.append("output_ids do not start with each row's prompt")
    if (ids[padding] != pad_id).any():
        problems.append(f"output_ids are not right-padded with pad id {pad_id} after each sequence")
    if (lp[prompt | padding] != 0).any():
        problems.append("logprobs must be 0 on prompt and padding positions")
    gen_lp = lp[generated]
    if not torch.isfinite(gen_lp).all() or (gen_lp > 1e-6).any():
        problems.append("logprobs of generated tokens must be finite and <= 0")
    return problems
