"""The ``reward_model`` environment: a reward model scores each rollout's conversation (NeMo-RL's
``env.reward_model``).

Started with the run, it reserves Ray workers of its own (``env.reward_model_cfg.resources``: a placement group
beside the policy's, never its bundles) and builds a value-head :class:`~rlcore.policy.Policy` on them
(``model_head="value"``): the trunk of ``model_name`` with ``score = Linear(hidden, 1)``, loaded from
``checkpoint_path`` when given (an ``rm`` run's ``weights/``, or a Hugging Face one-label sequence-classification
reward model, whose bias-less head gets a zero bias). It is frozen: no optimizer, no reference model.

Each step renders every conversation (the prompt's messages and the completion) through the reward model's own
tokenizer and chat template, message by message with BOS and EOS, as NeMo-RL's environment formats it
(:func:`rlcore.algorithms.sft.batches.encode_conversation`, :func:`with_eos`), pads the rows with one more position each
(:func:`rlcore.algorithms.rm.batches.with_score_position`) and reads the head at the last real token
(:func:`rlcore.algorithms.rm.scoring.scores_from_values`): the reward is that raw score, as NeMo-RL's Bradley-Terry
reward model returns it. The workers score ``batch_size`` conversations per forward pass. A conversation longer than
``max_model_len`` is not scored (reward 0 and an error, counted in ``env/errors``). The score is also the reward
component ``reward_model`` (its mean logged as ``reward/reward_model_mean``).

:meth:`RewardModelEnvironment.close` (the run's shutdown) stops the workers and removes the placement group.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore.algorithms.rm.environment_config import SECTION, RewardModelConfig, renamed_problem
from rlcore.interfaces.environment import EnvironmentReturn, Message

if TYPE_CHECKING:
    import torch

#: The reward component the score is logged as.
COMPONENT = "reward_model"


@dataclass(frozen=True)
class ConversationFormat:
    """How a conversation is tokenized for the reward model: NeMo-RL's ``get_formatted_message_log`` with
    ``add_bos_token`` and no generation prompt; its EOS is :func:`with_eos`'s."""

    add_bos: bool = True
    add_eos: bool = False
    add_generation_prompt: bool = False


def with_eos(tokenizer: Any, ids: list[int]) -> list[int]:
    """``ids`` ending in the tokenizer's EOS: appended unless the text already ends with it, before any trailing
    newlines (NeMo-RL's ``add_eos_token`` rule: Qwen's templates end a message with ``<|im_end|>\n``)."""
    eos = tokenizer.eos_token
    if eos is None or tokenizer.decode(ids).rstrip("\n").endswith(eos):
        return ids
    return [*ids, tokenizer.eos_token_id]


def ray_has_gpus() -> bool:
    """Whether the Ray cluster this process is attached to has GPUs (``resources.use_gpu: null``)."""
    import ray

    return bool(ray.cluster_resources().get("GPU", 0))


def load_reward_tokenizer(config: Any) -> Any:
    """The reward model's tokenizer (``config``: its resolved ``PolicyConfig``) with its chat template installed."""
    from transformers import AutoTokenizer

    from rlcore.config import ConfigError
    from rlcore.run.prompts import configure_tokenizer

    name = config.tokenizer.name or config.model_name
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        beside = Path(name).parent / "tokenizer"  # an rlcore checkpoint keeps it beside weights/
        fix = f"set it to {beside}" if (beside / "tokenizer_config.json").exists() else "set it to the tokenizer's"
        why = " ".join(str(exc).split())[:160]
        raise ConfigError(
            [f"{SECTION}.policy.tokenizer.name: no tokenizer loads from {name} ({why}); {fix} (the reward model's own)"]
        ) from None
    try:
        return configure_tokenizer(tokenizer, config.tokenizer)
    except ConfigError as exc:
        raise ConfigError([renamed_problem(line) for line in exc.problems]) from None


class RewardModelEnvironment:
    """Scores conversations with a reward model on workers of its own (see the module's docstring)."""

    def __init__(self, config: RewardModelConfig) -> None:
        from rlcore.config import ConfigError
        from rlcore.config.resolve import resolve_policy
        from rlcore.distributed import RayVirtualCluster
        from rlcore.policy import Policy
        from rlcore.preflight import check_policy_sources

        self.config = config
        res = config.resources
        use_gpu = ray_has_gpus() if res.use_gpu is None else res.use_gpu
        resolved = resolve_policy(config.policy_dict(), world_size=res.world_size, use_gpu=use_gpu)
        fields = (f"{SECTION}.checkpoint_path", "optimizer_path")
        if problems := check_policy_sources(resolved.config, config.checkpoint_path, fields=fields):
            raise ConfigError([renamed_problem(line) for line in problems])  # before any worker is reserved
        self.tokenizer = load_reward_tokenizer(resolved.config)
        self.template_kwargs = dict(resolved.config.tokenizer.chat_template_kwargs or {})
        self.cluster: Any = RayVirtualCluster(
            [res.workers_per_node] * res.num_nodes,
            use_gpus=use_gpu,
            num_cpus_per_bundle=res.num_cpus_per_worker,
            name="rlcore-reward-model",
        )
        self.policy: Any = None
        try:
            self.policy = Policy(
                self.cluster,
                resolved,
                self.tokenizer,
                name_prefix="reward_model",
                init_optimizer=False,
                init_reference_model=False,
                weights_path=config.checkpoint_path,
                model_head="value",
            )
            self.policy.prepare_for_lp_inference()
        except BaseException:
            self.close()
            raise

    def encode(self, message_log: list[Message]) -> list[int]:
        """The conversation's token ids as the reward model reads them."""
        from rlcore.algorithms.sft.batches import encode_conversation

        ids, _ = encode_conversation(self.tokenizer, message_log, ConversationFormat(), self.template_kwargs)
        return with_eos(self.tokenizer, ids)

    def scores(self, rows: list[list[int]]) -> torch.Tensor:
        """``[len(rows)]`` float32: the reward model's score at each row's last token."""
        from rlcore.algorithms.rm.batches import with_score_position
        from rlcore.algorithms.rm.scoring import scores_from_values
        from rlcore.algorithms.sft.batches import padded_batch
        from rlcore.algorithms.toolkit import pad_rows
        from rlcore.run.prompts import pad_id

        pad = pad_id(self.tokenizer)
        batch = with_score_position(padded_batch([(ids, [1] * len(ids)) for ids in rows], [True] * len(rows), pad), pad)
        dp = self.policy.sharding.dp
        batch = pad_rows(batch, -(-len(rows) // dp) * dp)  # copies of the first row: every rank gets whole rows
        values = self.policy.get_values(batch)["values"][: len(rows)]
        return scores_from_values(values, batch["input_lengths"][: len(rows)] - 1)

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        """Each conversation's score (see the module's docstring)."""
        encoded = [self.encode(log) for log in message_logs]
        limit = self.config.max_model_len
        fits = [i for i, ids in enumerate(encoded) if len(ids) <= limit]
        rewards = [0.0] * len(encoded)
        if fits:
            for i, score in zip(fits, self.scores([encoded[i] for i in fits]).tolist()):
                rewards[i] = float(score)
        errors: list[str | None] = [
            None
            if len(ids) <= limit
            else f"the conversation is {len(ids)} tokens, longer than {SECTION}.max_model_len ({limit}): not scored"
            for ids in encoded
        ]
        return EnvironmentReturn.final(rewards, metadata, errors=errors, reward_components={COMPONENT: rewards})

    def close(self) -> None:
        """Stop the reward model's workers and remove its placement group (each tried even if the other fails)."""
        policy, cluster, self.policy, self.cluster = self.policy, self.cluster, None, None
        try:
            if policy is not None:
                policy.shutdown()
        finally:
            if cluster is not None:
                cluster.shutdown()


__all__ = ["COMPONENT", "ConversationFormat", "RewardModelEnvironment", "with_eos"]
