"""Registers the built-in algorithms through the public hook, as a third party would (light: only names). Each
algorithm is one package: its config class, the top-level sections it owns (GRPO's ``loss``) and its rules are
named here by import path, so a config validates without importing a loop."""

from rlcore.plugins import AlgorithmSpec, hookimpl

#: ``name: (config class, algorithm class, what it is, the spec's flags)``; the name is the config section's key.
_BUILTIN = {
    "grpo": (
        "rlcore.algorithms.grpo.config:GRPOConfig",
        "rlcore.algorithms.grpo.loop:GRPO",
        "Group Relative Policy Optimization on scored rollouts (synchronous or asynchronous, dynamic sampling); "
        "the algorithm of a config without an algorithm section.",
        {
            "default": True,
            "generates": True,
            "sections": {"loss": "rlcore.algorithms.grpo.loss_config:ClippedPGLossConfig"},
            "rules": "rlcore.algorithms.grpo.rules:check",
        },
    ),
    "sft": (
        "rlcore.algorithms.sft.config:SFTConfig",
        "rlcore.algorithms.sft.loop:SFT",
        "Supervised fine-tuning: NLL on the assistant tokens of data.train.",
        {
            "unread_sections": {
                "loss": "the policy-gradient loss (sft has its own)",
                "env": "the environment that scores completions",
            }
        },
    ),
    "dpo": (
        "rlcore.algorithms.dpo.config:DPOConfig",
        "rlcore.algorithms.dpo.loop:DPO",
        "Direct Preference Optimization on (prompt, chosen, rejected) pairs against the frozen initial weights.",
        {
            "unread_sections": {
                "loss": "the policy-gradient loss (dpo has its own)",
                "env": "the environment that scores completions",
            }
        },
    ),
    "ppo": (
        "rlcore.algorithms.ppo.config:PPOConfig",
        "rlcore.algorithms.ppo.loop:PPO",
        "Proximal Policy Optimization with a critic: a value model trained beside the policy gives GAE's per-token "
        "advantages; ppo_epochs updates of the critic, then the policy, per rollout.",
        {
            "generates": True,
            "sections": {
                "loss": "rlcore.algorithms.grpo.loss_config:ClippedPGLossConfig",
                "value_loss": "rlcore.algorithms.ppo.config:ValueLossConfig",
            },
        },
    ),
    "distillation": (
        "rlcore.algorithms.distillation.config:DistillationConfig",
        "rlcore.algorithms.distillation.loop:Distillation",
        "On-policy distillation: the student trains on the KL to a frozen teacher's top-k logits over "
        "its own rollouts.",
        {
            "generates": True,
            "unread_sections": {"loss": "the policy-gradient loss (distillation trains the KL to the teacher)"},
        },
    ),
    "rm": (
        "rlcore.algorithms.rm.config:RMConfig",
        "rlcore.algorithms.rm.loop:RM",
        "Reward-model training: the policy as a value model (trunk + scalar head) trained with the Bradley-Terry "
        "loss on (prompt, chosen, rejected) pairs.",
        {
            "unread_sections": {
                "loss": "the policy-gradient loss (rm trains the Bradley-Terry loss)",
                "env": "the environment that scores completions",
            }
        },
    ),
}


@hookimpl
def rlcore_register_algorithms(register):
    for name, (config_class, algorithm_class, description, flags) in _BUILTIN.items():
        register(
            AlgorithmSpec(
                name=name, config_class=config_class, algorithm_class=algorithm_class, description=description, **flags
            )
        )
