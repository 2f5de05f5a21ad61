"""The backend conformance kit: the contracts of design.md §2 as test classes.

A backend's test suite subclasses a kit class with a tiny configuration; the
tests that need a capability the backend does not declare skip themselves::

    # conftest.py
    pytest_plugins = ["rlcore.testing.pytest_plugin"]

    # test_conformance.py
    from rlcore.testing.conformance import TrainingBackendConformance

    class TestMyBackend(TrainingBackendConformance):
        backend_name = "mybackend"
        plugin = None          # installed via entry points; or the plugin module/object
        world_size = 2

        def policy_overrides(self):
            return {"mybackend_cfg": {"fused_kernels": False}}

:class:`TrainingBackendConformance` checks, against a tiny Llama built
locally:

- the plugin module is light (importing it and running its hook pulls in no
  torch/ray/vllm/megatron) and the spec is valid (its worker class resolves,
  in a fresh interpreter, to a class with every required method);
- logprob shape and alignment ([B, S] float32, position 0 and padding 0,
  equal to a single-process Hugging Face float32 forward);
- loss and gradient invariance: one NLL step, then one clipped-PG step with a
  KL penalty, sequence-level normalisation and a masked sample, give the same
  losses, gradient norms and post-step weights (SGD, read back from the saved
  checkpoint) as a single-process oracle and as a 1-rank policy, for dp =
  world size, another micro-batch size, dynamic batching and sequence packing
  (the last two when declared);
- reference logprobs after training equal the initial logprobs, and the swap
  leaves the trained weights in place;
- checkpoints resume training: Adam + LR warm-up, save after step 1, a new
  ``Policy(weights_path=..., optimizer_path=...)`` trains on and matches
  uninterrupted training; a lost optimizer or scheduler state is named
  (:mod:`rlcore.testing.conformance.resume_check`); the weights load with ``AutoModelForCausalLM``;
- ``prepare_refit_info`` (only when 'refit' is declared) and
  ``get_topk_logits`` (only when 'topk_logits' is declared).

One set of policies is shared per test class and each one is trained at most
once, so the whole class runs in well under two minutes on two CPU cores.

:class:`GenerationBackendConformance` is the matching kit for generation
backends (the vLLM backend runs it: ``plugins/rl-vllm/tests/test_generation.py``).

The pure checkers (:func:`logprob_problems`, :func:`weight_problems`,
:func:`generation_output_problems`) return lists of problem lines; they are
public so that a backend can reuse them in its own tests.

The kit is split by concern; every name is importable from here:

- :mod:`~rlcore.testing.conformance.backend_checks`: what every backend kind
  shares (plugin module light, spec valid; ``HEAVY_MODULES``, the required
  worker methods), run through :mod:`~rlcore.testing.conformance.probes` (the
  fresh-interpreter probes, :func:`plugin_reference`);
- :mod:`~rlcore.testing.conformance.training`: :class:`TrainingBackendConformance`,
  with its class-wide state in :mod:`~rlcore.testing.conformance.training_kit`;
- :mod:`~rlcore.testing.conformance.generation`: :class:`GenerationBackendConformance`;
- :mod:`~rlcore.testing.conformance.lifecycle`: :func:`lifecycle_problems`, the engine lifecycle of
  'async_engine' backends (pause in each mode, resume, requests submitted while paused or draining, sleep and
  wake twice, refit while paused, identity refit, a restarted engine stale until refit) as pure checks, with
  in-process fakes in :mod:`~rlcore.testing.conformance.lifecycle_fakes`; the pytest mixin
  :class:`EngineLifecycleConformance` is :mod:`~rlcore.testing.conformance.lifecycle_conformance`;
- :mod:`~rlcore.testing.conformance.value_model`: :class:`ValueModelConformance`, the value-model checks of
  'value_head' backends (a mixin for a ``TrainingBackendConformance`` subclass), with :func:`hf_values` (the
  float64 reference) and :class:`SquaredErrorValueLoss`;
- :mod:`~rlcore.testing.conformance.checkers`: :func:`logprob_problems`,
  :func:`generation_output_problems`; the oracles and the step/weight checkers
  are :mod:`rlcore.testing.oracle`.
"""

from rlcore.testing.conformance.backend_checks import (
    CAPABILITY_METHODS,
    GENERATION_WORKER_METHODS,
    HEAVY_MODULES,
    TRAINING_WORKER_METHODS,
    _BackendChecks,  # noqa: F401 - importable from here, as before the split
)
from rlcore.testing.conformance.checkers import (
    generation_output_problems,
    logprob_problems,
)
from rlcore.testing.conformance.generation import GenerationBackendConformance
from rlcore.testing.conformance.lifecycle import LifecycleSubject, lifecycle_problems
from rlcore.testing.conformance.lifecycle_conformance import EngineLifecycleConformance
from rlcore.testing.conformance.probes import plugin_reference
from rlcore.testing.conformance.training import TrainingBackendConformance
from rlcore.testing.conformance.training_kit import (
    _TrainingKit,  # noqa: F401 - rlcore's own kit tests drive it
    distillation_step,
    dpo_step,
)
from rlcore.testing.conformance.value_model import (
    SquaredErrorValueLoss,
    ValueModelConformance,
    hf_values,
    value_sgd_step,
)
from rlcore.testing.oracle import (  # re-exported: the oracles and checkers are part of the kit's public API
    StepRecord,
    close,  # noqa: F401
    hf_token_logprobs,
    load_hf_model,
    oracle_gradients,
    single_process_sgd,
    state_copy,  # noqa: F401
    step_problems,  # noqa: F401
    train_and_save_step,
    weight_problems,
)

__all__ = [
    "CAPABILITY_METHODS",
    "GENERATION_WORKER_METHODS",
    "HEAVY_MODULES",
    "TRAINING_WORKER_METHODS",
    "EngineLifecycleConformance",
    "GenerationBackendConformance",
    "LifecycleSubject",
    "SquaredErrorValueLoss",
    "StepRecord",
    "TrainingBackendConformance",
    "ValueModelConformance",
    "distillation_step",
    "dpo_step",
    "generation_output_problems",
    "hf_token_logprobs",
    "hf_values",
    "lifecycle_problems",
    "load_hf_model",
    "logprob_problems",
    "oracle_gradients",
    "plugin_reference",
    "single_process_sgd",
    "train_and_save_step",
    "value_sgd_step",
    "weight_problems",
]
