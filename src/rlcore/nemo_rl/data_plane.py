"""NeMo-RL's TransferQueue ``data_plane`` and the single-controller ``async_rl`` section that runs on it.

With ``data_plane.enabled`` NeMo-RL's ``run_grpo.py`` trains through ``grpo_train_sync``
(nemo_rl/algorithms/grpo_sync.py): the same synchronous loop as ``grpo_train``, its batches moved through
TransferQueue storage instead of Ray object refs, checked for parity against it by NeMo-RL. That changes no
number, so the section is ignored.

``async_rl`` configures another loop, ``run_grpo_single_controller.py`` (which requires the data plane). With its
``in_order`` sampler it is rlcore's asynchronous GRPO with in-flight weight updates: the batch of step ``s`` is
dispatched once the trainer holds ``v(s - max_lookahead_versions)`` (``_GatedSampler.admit``) and trained at step
``s`` (``InOrderSampler.select``); a weight sync does not drain the requests running, they continue on the new
weights (``SingleControllerActor._sync_weights``), optionally recomputing their KV caches. So
``max_lookahead_versions`` is ``grpo.async_grpo.max_trajectory_age_steps``, ``in_flight_weight_updates`` is on
(``in_flight_pause_mode: keep``), and ``recompute_kv_cache_after_weight_updates`` carries over. The other samplers
train on whatever ready groups fit a staleness window, which rlcore does not do; the resiliency blocks are
ignored where they are off or only report, and refused where they would drop prompts or act on a failure in a
way rlcore does not (nemo_rl/algorithms/single_controller_utils/config.py).
"""

from __future__ import annotations

from typing import Any

from rlcore.config.messages import show_value
from rlcore.nemo_rl.conversion import Conversion, get, is_neutral, put, unknown_problem
from rlcore.nemo_rl.table import UNKNOWN_NEUTRAL

TRANSPORT = (
    "TransferQueue moves the same batches between the same steps (NeMo-RL's grpo_train_sync, parity-tested "
    "against grpo_train); rlcore passes them directly"
)
SC = "async_rl"
ASYNC = "grpo.async_grpo"
#: Why a KV-cache recompute setting is ignored where every refit waits for the requests running.
NOTHING_TO_RECOMPUTE = (
    "no request runs across a refit, and the engines drop their prefix cache after each: nothing computed on "
    "older weights remains to recompute"
)

#: NeMo-RL's samplers other than in_order (nemo_rl/algorithms/async_utils/staleness_sampler.py), by what they do.
OTHER_SAMPLERS = {
    "weight_fifo": "trains each step on the ready groups whose weights are within max_staleness_versions of the "
    "trainer's, oldest weights first, whichever step they were dispatched for",
    "windowed": "over-samples and trains on any ready groups within max_staleness_versions of the trainer's weights",
    "ready_first": "trains each step on the groups that finished first, whichever step they were dispatched for",
    "custom": "is a sampler of the user's own (a module:Class)",
}

#: ``async_rl`` keys that change no number rlcore computes, with why.
IGNORED = {
    "min_groups_for_streaming_train": "the streaming trainer takes a step's groups in chunks of at least this many "
    "as they finish, accumulating gradients normalised over the whole step: one optimizer step on all of the "
    "step's groups, as rlcore trains the whole rollout",
    "max_inflight_prompts": "a cap on the prompt groups generating at once (throughput): rlcore submits every group "
    "of the rollouts in flight; which weights a token comes from is a matter of timing either way, within the "
    "age limit",
    "diagnostics": "per-rollout prints (prompts, completion previews)",
}


def data_plane(nemo: dict[str, Any], out: Conversion) -> None:
    """``data_plane`` ignored as transport; ``async_rl`` mapped when it is the loop that runs, else ignored."""
    section = nemo.get("data_plane")
    enabled = isinstance(section, dict) and section.get("enabled") is True
    if "data_plane" in nemo:
        out.ignored.append(
            ("data_plane", TRANSPORT if enabled else "off: batches go from the driver to the workers directly")
        )
    if nemo.get(SC) not in (None, {}):
        if enabled:
            single_controller(nemo, out)
        else:
            out.ignored.append(
                (
                    SC,
                    "read only by NeMo-RL's single-controller script, which refuses to start without "
                    "data_plane.enabled; run_grpo.py does not read it",
                )
            )
    if enabled and nemo.get(SC) not in (None, {}) and get(nemo, ASYNC) is not None:
        out.problems.append(
            f"{ASYNC}: is set, but NeMo-RL's single-controller loop (async_rl with data_plane.enabled) refuses it "
            f"(run_grpo_single_controller.py: 'SC requires grpo.async_grpo: null'); set {ASYNC}: null"
        )
    elif enabled and get(nemo, f"{ASYNC}.enabled") is True:
        out.problems.append(
            f"{ASYNC}.enabled: is true with data_plane.enabled: true, a pair NeMo-RL's run_grpo.py does not run "
            "(async GRPO with TransferQueue is its single-controller script's, configured by async_rl, which "
            f"refuses {ASYNC}); set data_plane.enabled: false for rlcore's asynchronous GRPO"
        )


def single_controller(nemo: dict[str, Any], out: Conversion) -> None:
    """NeMo-RL's single-controller ``async_rl`` section as rlcore's asynchronous GRPO (see the module doc)."""
    sc = nemo[SC]
    if not isinstance(sc, dict):
        out.problems.append(unknown_problem(SC, sc))
        return
    lookahead = _sampler(sc.get("sampler"), out)
    recompute = sc.get("recompute_kv_cache_after_weight_updates")
    if lookahead is not None and lookahead > 0:
        settings = {
            "enabled": True,
            "max_trajectory_age_steps": lookahead,
            "in_flight_weight_updates": True,  # _sync_weights never drains the requests running
        }
        if recompute is not None:
            settings["recompute_kv_cache_after_weight_updates"] = recompute
        for key, value in settings.items():
            put(out.config, f"{ASYNC}.{key}", value)
            out.sources[f"{ASYNC}.{key}"] = f"{SC}.{key}" if key.startswith("recompute") else f"{SC}.sampler"
        _buffer(nemo, sc, lookahead, out)
    elif lookahead == 0 and recompute is not None:
        out.ignored.append((f"{SC}.recompute_kv_cache_after_weight_updates", NOTHING_TO_RECOMPUTE))
    for key, why in IGNORED.items():
        if key in sc:
            out.ignored.append((f"{SC}.{key}", why))
    _rollout_failure(sc.get("rollout_failure"), out)
    _stall_watchdog(sc.get("stall_watchdog"), out)
    _switched(sc, "generation_fleet_health", FLEET_HEALTH, out)
    _switched(sc, "generation_router", ROUTER, out)
    known = {"sampler", "recompute_kv_cache_after_weight_updates", "max_buffered_rollouts", *IGNORED}
    known |= {"rollout_failure", "stall_watchdog", "generation_fleet_health", "generation_router"}
    for key, value in sc.items():
        if key not in known:
            _unknown(f"{SC}.{key}", value, out)


def _sampler(sampler: Any, out: Conversion) -> int | None:
    """``max_lookahead_versions`` of an in_order sampler (NeMo-RL's default: in_order, 1), else None (refused)."""
    sampler = {} if sampler is None else sampler
    path = f"{SC}.sampler"
    if not isinstance(sampler, dict):
        out.problems.append(unknown_problem(path, sampler))
        return None
    name = sampler.get("name", "in_order")
    if name != "in_order":
        what = OTHER_SAMPLERS.get(str(name), "is not one of NeMo-RL's samplers")
        out.problems.append(
            f"{path}.name: is {show_value(name)}, which {what}; rlcore's asynchronous GRPO trains each step on the "
            f"rollout dispatched for it, as the in_order sampler does: set {path}.name: in_order with "
            "max_lookahead_versions"
        )
        return None
    lookahead = sampler.get("max_lookahead_versions", 1)
    if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0:
        out.problems.append(
            f"{path}.max_lookahead_versions: is {show_value(lookahead)}; it must be a whole number >= 0"
        )
        return None
    if lookahead == 0:
        out.ignored.append(
            (
                f"{path}.max_lookahead_versions",
                "0: each batch is dispatched after the refit to the weights that train it, which is synchronous "
                "GRPO (rlcore's grpo.async_grpo.enabled: false)",
            )
        )
    for key in sampler:
        if key not in ("name", "max_lookahead_versions"):
            out.ignored.append((f"{path}.{key}", "not read by the in_order sampler"))
    return lookahead


def _buffer(nemo: dict[str, Any], sc: dict[str, Any], lookahead: int, out: Conversion) -> None:
    """``max_buffered_rollouts``: NeMo-RL refuses less than the in_order sampler's capacity (its rollout pump
    would deadlock); at or above it, it holds nothing back that rlcore would generate."""
    if "max_buffered_rollouts" not in sc:
        return
    value, prompts = sc["max_buffered_rollouts"], get(nemo, "grpo.num_prompts_per_step")
    path = f"{SC}.max_buffered_rollouts"
    if isinstance(prompts, int) and isinstance(value, int) and value < prompts * (lookahead + 1):
        out.problems.append(
            f"{path}: is {value}, below the in_order sampler's capacity grpo.num_prompts_per_step × "
            f"(max_lookahead_versions + 1) = {prompts * (lookahead + 1)}, which NeMo-RL refuses (its rollout pump "
            "would deadlock); raise it to at least that"
        )
    else:
        out.ignored.append(
            (
                path,
                "backpressure on the groups waiting to be trained; at or above the in_order sampler's capacity "
                "(grpo.num_prompts_per_step × (max_lookahead_versions + 1), the rollouts rlcore keeps in flight) "
                "it holds nothing back",
            )
        )


def _rollout_failure(block: Any, out: Conversion) -> None:
    """Refused where it lets a step train on fewer groups, or sets a deadline (rlcore has none); otherwise the
    whole block is ignored: no prompt is ever dropped, so every step trains its whole batch or the run stops."""
    if block in (None, {}):
        return
    path = f"{SC}.rollout_failure"
    if not isinstance(block, dict):
        out.problems.append(unknown_problem(path, block))
        return
    refused = False
    budgets = {k: block.get(k, 0) for k in ("max_skipped_prompts", "max_consecutive_dropped_prompts")}
    if any(budgets.values()):
        refused = True
        out.problems.append(
            f"{path}.max_skipped_prompts, {path}.max_consecutive_dropped_prompts: are "
            f"{', '.join(show_value(v) for v in budgets.values())}, so a prompt whose rollout keeps failing may be "
            "dropped and its step trained on fewer groups; rlcore trains every step on its whole batch or stops "
            "the run: set both to 0"
        )
    native = block.get("native") or {}
    for key in ("generation_timeout_s", "env_timeout_s"):
        if isinstance(native, dict) and native.get(key) is not None:
            refused = True
            out.problems.append(
                f"{path}.native.{key}: is {show_value(native[key])}, a deadline after which NeMo-RL retries the "
                "call elsewhere; rlcore has no generation or environment deadline (docs/engine-faults.md): set it "
                "to null"
            )
    if not refused:
        out.ignored.append(
            (
                path,
                "no prompt may be dropped (max_skipped_prompts and max_consecutive_dropped_prompts 0), so every "
                "step trains its whole batch or the run stops, as in rlcore; the attempts and backoff say how a "
                "failed rollout is retried first (rlcore restarts a dead engine and redoes its requests: "
                "docs/engine-faults.md); nemo_gym: NeMo-Gym's rollouts, which rlcore does not run",
            )
        )


def _stall_watchdog(block: Any, out: Conversion) -> None:
    if block in (None, {}):
        return
    path = f"{SC}.stall_watchdog"
    action = block.get("stall_action", "warn") if isinstance(block, dict) else block
    if action == "warn":
        out.ignored.append((path, "with stall_action warn it prints a warning when no rollout finishes for a while"))
    else:
        out.problems.append(
            f"{path}.stall_action: is {show_value(action)}: NeMo-RL then ends a run in which no rollout finished for "
            "stall_timeout_s; rlcore has no stall watchdog (docs/engine-faults.md): set it to warn"
        )


FLEET_HEALTH = (
    "NeMo-RL then probes each generation shard, quarantines one that fails and stops the run below "
    "min_healthy_shards; rlcore restarts a dead engine instead (docs/engine-faults.md)"
)
ROUTER = "NeMo-RL then puts an HTTP router in front of the engines for NeMo-Gym, which rlcore does not run"


def _switched(sc: dict[str, Any], key: str, what: str, out: Conversion) -> None:
    """A block with an ``enabled`` switch: ignored while off, refused when on."""
    if sc.get(key) in (None, {}):
        return
    path = f"{SC}.{key}"
    block = sc[key]
    on = block.get("enabled", False) if isinstance(block, dict) else block
    if on in (False, None):
        out.ignored.append((path, "off"))
    else:
        out.problems.append(f"{path}.enabled: is {show_value(on)}: {what}; set it to false")


def _unknown(path: str, value: Any, out: Conversion) -> None:
    if is_neutral(value, UNKNOWN_NEUTRAL):
        out.ignored.append((path, "not known to rlcore's NeMo-RL reader; its value changes nothing"))
    else:
        out.problems.append(unknown_problem(path, value))


def kv_recompute(nemo: dict[str, Any], out: Conversion) -> None:
    """``grpo.async_grpo.recompute_kv_cache_after_weight_updates``: as it is with in-flight weight updates; without
    them ignored, saying why: every refit then waits for the requests running (NeMo-RL's non-in-flight path drains
    too) and the engines drop their prefix cache after it, so every later request is computed on the new
    weights already (rlcore refuses the setting where it could not act)."""
    path = f"{ASYNC}.recompute_kv_cache_after_weight_updates"
    value = get(nemo, path)
    if value is None:
        return
    if value is True and get(nemo, f"{ASYNC}.in_flight_weight_updates") is not True:
        out.ignored.append((path, f"without in-flight weight updates {NOTHING_TO_RECOMPUTE}"))
        return
    put(out.config, path, value)
    out.sources[path] = path


__all__ = ["TRANSPORT", "data_plane", "kv_recompute", "single_controller"]
