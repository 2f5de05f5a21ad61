"""rlcore plugin entry point: declares the ``verifiers`` environment (imports nothing but rlcore's plugin module)."""

from rlcore.plugins import EnvironmentSpec, hookimpl


@hookimpl
def rlcore_register_environments(register):
    register(
        EnvironmentSpec(
            name="verifiers",
            environment_class="rl_verifiers.environment:VerifiersEnvironment",
            config_class="rl_verifiers.config:VerifiersConfig",
            requires=("verifiers",),
            install_hint="pip install rl-verifiers  (brings verifiers==0.4.0)",
            description="An agent environment: a verifiers (0.4, verifiers.v1) environment plays each sample "
            "against the policy's OpenAI-compatible endpoint; its rubric's weighted rewards are the reward "
            "(each reward function a component).",
        )
    )
