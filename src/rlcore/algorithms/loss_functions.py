"""The losses rlcore's algorithms ship, in one import place (each lives in its algorithm's package).

``from rlcore.algorithms.loss_functions import NLLLoss`` is the path the README and the backends' tests use for a
plain training loss; it stays. ``ClippedPGLossFn`` is GRPO's (:mod:`rlcore.algorithms.grpo.loss`), ``NLLLoss``
SFT's (:mod:`rlcore.algorithms.sft.loss`). Importing this module does not import torch.
"""

from rlcore.algorithms.grpo.loss import ClippedPGLossConfig, ClippedPGLossFn, positive_example_token_counts
from rlcore.algorithms.sft.loss import NLLLoss

__all__ = ["ClippedPGLossConfig", "ClippedPGLossFn", "NLLLoss", "positive_example_token_counts"]
