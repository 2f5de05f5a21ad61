"""rl-verifiers: Prime Intellect's verifiers (0.4, ``verifiers.v1``) environments as rlcore agent environments.

Light on purpose: importing the package imports neither verifiers nor the OpenAI client. The adapter lives in
:mod:`rl_verifiers.environment`; the harness that runs verifiers' chat program with this Python is the top-level
package ``rl_verifiers_harness`` (verifiers finds a harness by a top-level module name).
"""

__version__ = "0.1.0"
