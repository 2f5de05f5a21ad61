"""The megatron worker with one method added for the negative control of test_megatron_sequence_parallel.py:
``unmark_sequence_parallel_norms`` takes the ``sequence_parallel`` mark off the norms' parameters, so megatron's
``finalize_model_grads`` stops summing their gradients over the tensor-parallel group. Until it is called the
worker is the production one. Test code only; imported inside the Ray worker processes."""

from __future__ import annotations

from rl_megatron.worker import MegatronPolicyWorker


class NormMarkSwitchWorker(MegatronPolicyWorker):
    def unmark_sequence_parallel_norms(self) -> list[str]:
        """Unmark every parameter marked ``sequence_parallel`` (the norms'; a MoE's routers' too); their names."""
        names = []
        for name, param in self.gpt.named_parameters():
            if getattr(param, "sequence_parallel", False):
                param.sequence_parallel = False
                names.append(name)
        return names
