"""rl-vllm: the vLLM generation backend of rlcore.

Light on purpose: importing the package imports neither torch nor vLLM. The
engine-side code lives in :mod:`rl_vllm.worker` (imported inside Ray actors)
and the driver-side facade in :mod:`rl_vllm.generation`.
"""

__version__ = "0.1.0"
