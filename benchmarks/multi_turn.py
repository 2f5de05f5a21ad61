"""Multi-turn rollouts, two measurements (the first argument chooses; without one, ``throughput``).

**throughput**: generation throughput of a multi-turn rollout vs a single-turn one of the same total generated
tokens. One vLLM engine, one model (``small``: a ~24M-parameter Llama built from a
config, float32), ``--prompts`` random prompts of 16-48 tokens. Both sides go
through :func:`rlcore.run.rollouts.run_rollout`, the code a GRPO step runs:

- **1 turn**: ``max_new_tokens = turns x --tokens-per-turn``;
- **N turns**: ``max_new_tokens = --tokens-per-turn`` per turn; between turns an
  environment that never ends the episode answers with a ``--obs-tokens``-token
  observation, so each later turn re-sends (prefills) the whole sequence so far.

The random model rarely samples EOS (1 of ~260 tokens), so both sides generate
nearly the same number of tokens (each side's mean is printed); tokens/s is
generated tokens over the wall time of the rollout as the driver sees it
(generation, the environment step and the turn bookkeeping; the table splits
it into the engine calls and everything else). One engine
serves both sides; only ``max_new_tokens`` changes between them. After a warm-up
each, the sides alternate ``--repeats`` times; medians are reported.

    python benchmarks/multi_turn.py [throughput] [--prompts 32] [--turns 3] [--tokens-per-turn 32] \
        [--obs-tokens 8] [--repeats 5]

The last line printed is JSON: ``{"single_turn_tok_s": ..., "multi_turn_tok_s": ..., "ratio": ...}``.

**tokens**: the turn bookkeeping of tokens-in/tokens-out (the engine's ids kept, each turn's new messages
encoded with :func:`rlcore.chat.templates.appended_ids` and appended) against re-tokenizing (the whole
conversation rendered through the chat template and encoded again every turn), at 8, 32 and 128 turns, beside
the generation time of the same turns. The tokenizer is the tiny byte-level one with ChatML's special tokens
and a Qwen2.5-style ChatML template built here (tools in the system turn, tool results as ``<tool_response>``
in a user turn); the engine is one rl-vllm engine over the tiny model (vocabulary grown to hold the specials,
16384 positions). Per turn count, ``--samples`` conversations run that many turns on the engine: each turn
generates up to ``--tokens-per-turn`` tokens (stopping at ``<|im_end|>``), then a calculator tool message is
appended as tokens-in/tokens-out does (those ids are the next turn's engine input). Generation is measured once
per turn count (the engine calls' wall time); the bookkeeping of both approaches is then replayed on the
recorded completions ``--repeats`` times (medians), and each re-tokenized turn is compared with the ids the
engine was given (a decoded completion that does not encode back, e.g. bytes that are not UTF-8, differs).

    python benchmarks/multi_turn.py tokens [--turns 8,32,128] [--samples 8] [--tokens-per-turn 16] [--repeats 5]

The last line printed is JSON: per turn count the seconds of each approach, the generation seconds, the ratio
bookkeeping / generation and the count of re-tokenized turns that differ; and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

from interleave import interleaved

MODEL = dict(
    arch="llama",
    hidden_size=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    intermediate_size=1408,
    max_position_embeddings=512,
)
MAX_LEN = 512


class ChattyEnvironment:
    """Reward 0, never done, a fixed observation (the multi-turn side's environment)."""

    def __init__(self, observation: str) -> None:
        self.observation = observation

    def step(self, logs, metadata):
        from rlcore.interfaces.environment import EnvironmentReturn

        n = len(logs)
        return EnvironmentReturn(
            [{"role": "environment", "content": self.observation}] * n, list(metadata), [0.0] * n, [False] * n
        )


def throughput(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="multi-turn vs single-turn generation throughput")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens-per-turn", type=int, default=32)
    parser.add_argument("--obs-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    import transformers

    from rl_vllm.generation import VllmGeneration
    from rlcore.config import load_config_dict
    from rlcore.datasets import Sample
    from rlcore.distributed import RayVirtualCluster, shutdown_ray
    from rlcore.run.rollouts import run_rollout
    from rlcore.run.step import Timer
    from rlcore.testing.models import build_tiny_tokenizer, make_batch, tiny_model_path

    transformers.utils.logging.disable_progress_bar()
    model_dir = tiny_model_path(**MODEL)
    tokenizer = build_tiny_tokenizer()
    raw = make_batch(tokenizer, args.prompts, 16, 48, seed=0)
    texts = [
        tokenizer.decode(row[:n].tolist(), skip_special_tokens=True)
        for row, n in zip(raw["input_ids"], raw["input_lengths"].tolist())
    ]
    samples = [Sample(i, [{"role": "user", "content": t}], {}) for i, t in enumerate(texts)]
    observation = "o" * args.obs_tokens  # one byte = one token for the tiny tokenizer
    total = args.turns * args.tokens_per_turn

    def engine_cfg(new_tokens: int):
        return load_config_dict(
            {
                "policy": {
                    "model_name": model_dir,
                    "precision": "float32",
                    "train_global_batch_size": 1,
                    "max_total_sequence_length": MAX_LEN,
                    "generation": {
                        "backend": "vllm",
                        "max_new_tokens": new_tokens,
                        "temperature": 1.0,
                        "pad_token_id": tokenizer.pad_token_id,
                        "vllm_cfg": {"kv_cache_space_gb": 0.25, "max_model_len": MAX_LEN},
                    },
                }
            }
        ).policy

    def run_cfg(turns: int):
        return SimpleNamespace(
            grpo=SimpleNamespace(max_rollout_turns=turns),
            policy=SimpleNamespace(
                max_total_sequence_length=MAX_LEN, tokenizer=SimpleNamespace(chat_template_kwargs={})
            ),
        )

    print(
        f"model small ({MODEL['hidden_size']}x{MODEL['num_layers']}, float32); {args.prompts} prompts of 16-48 "
        f"tokens; 1 turn x {total} tokens vs {args.turns} turns x {args.tokens_per_turn} tokens with a "
        f"{args.obs_tokens}-token observation between turns; one vLLM engine; {args.repeats} repeats after a "
        f"warm-up; load average {os.getloadavg()[0]:.1f}",
        file=sys.stderr,
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    cluster = RayVirtualCluster([1], max_colocated_worker_groups=1, name="bench-multi-turn")
    engine = None
    try:
        engine = VllmGeneration(cluster, engine_cfg(total).generation, name_prefix="bench-multi-turn")
        sides = {"single": (1, total), "multi": (args.turns, args.tokens_per_turn)}

        def rate(side: str) -> tuple[float, float, float, float]:
            """Tokens/s, tokens per sample, seconds in the engine, seconds elsewhere."""
            turns, new_tokens = sides[side]
            engine.cfg = engine.cfg.model_copy(update={"max_new_tokens": new_tokens})  # read at every request
            timer = Timer()
            t0 = time.perf_counter()
            rollout = run_rollout(
                run_cfg(turns),
                lambda b: engine.generate(b, greedy=False),
                ChattyEnvironment(observation),
                tokenizer,
                samples,
                1,
                timer,
            )
            seconds = time.perf_counter() - t0
            generated = float(rollout.data["generation_lengths"].sum())
            in_engine = timer.seconds["time/generation_s"]
            return generated / seconds, generated / len(samples), in_engine, seconds - in_engine

        runs = interleaved(sides, rate, args.repeats)
    finally:
        if engine is not None:
            engine.shutdown()
        cluster.shutdown()
        shutdown_ray()

    rates, lengths, engine_s, other_s = ({side: [run[k] for run in r] for side, r in runs.items()} for k in range(4))
    med = {side: statistics.median(r) for side, r in rates.items()}
    print(
        f"{'rollout':<10}{'median tok/s':>14}{'min':>10}{'max':>10}{'tokens/sample':>15}{'engine s':>10}{'other s':>9}"
    )
    for side in rates:
        print(
            f"{side:<10}{med[side]:>14.1f}{min(rates[side]):>10.1f}{max(rates[side]):>10.1f}"
            f"{statistics.mean(lengths[side]):>15.1f}{statistics.median(engine_s[side]):>10.2f}"
            f"{statistics.median(other_s[side]):>9.3f}"
        )
    ratio = med["multi"] / med["single"]
    print(f"{args.turns}-turn / 1-turn tokens/s: {ratio:.2f}x")
    print(
        json.dumps(
            {
                "single_turn_tok_s": round(med["single"], 1),
                "multi_turn_tok_s": round(med["multi"], 1),
                "ratio": round(ratio, 3),
                "load": round(os.getloadavg()[0], 1),
            }
        )
    )


#: ChatML in Qwen2.5's layout, written for this benchmark: the tools listed in the system turn, a tool result
#: as a <tool_response> block in a user turn (consecutive results share it), every turn closed by <|im_end|>.
CHATML_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' + (messages[0].content if messages[0].role == 'system' else "
    "'You are a helpful assistant.') + '\\n\\n# Tools\\n\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    '{{- \'\\n</tools>\\n\\nCall a function as <tool_call>{"name": ..., "arguments": ...}\' -}}'
    "{{- '</tool_call><|im_end|>\\n' -}}"
    "{%- elif messages[0].role != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif not (m.role == 'system' and loop.first and tools) -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
TOKENS_MAX_LEN = 16384  # 128 turns of ChatML with a tools system turn: about 11k tokens


def chatml_tokenizer():
    """The tiny byte-level tokenizer with ChatML's specials (``<|im_end|>`` the EOS, no BOS) and the template."""
    from rlcore.models.tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.bos_token, tokenizer.eos_token = None, "<|im_end|>"
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tool_message(turn: int) -> dict[str, str]:
    return {"role": "tool", "content": str(turn * 7919 % 100003), "name": "calculator"}


def tokens_in_tokens_out(tokenizer, prompt, tools, completions) -> list[list[int]]:
    """Each turn's engine input as tokens-in/tokens-out builds it: the ids so far, the completion, the appended
    ids of the tool message."""
    from rlcore.chat.templates import prompt_ids

    ids = prompt_ids(tokenizer, prompt, tools=tools)
    inputs = [list(ids)]
    for turn, completion in enumerate(completions[:-1]):
        ids.extend(completion)
        ids.extend(appended_ids_for(tokenizer, turn, tools, completion))
        inputs.append(list(ids))
    return inputs


def retokenized(tokenizer, prompt, tools, completions) -> list[list[int]]:
    """Each turn's engine input re-tokenized: the conversation (completions decoded) rendered and encoded whole."""
    from rlcore.chat.templates import encode_rendered, render

    messages = list(prompt)
    inputs = [encode_rendered(tokenizer, render(tokenizer, messages, True, tools))]
    for turn, completion in enumerate(completions[:-1]):
        text = tokenizer.decode(completion, skip_special_tokens=True)
        messages += [{"role": "assistant", "content": text}, tool_message(turn)]
        inputs.append(encode_rendered(tokenizer, render(tokenizer, messages, True, tools)))
    return inputs


def tokens(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="turn bookkeeping: tokens-in/tokens-out vs re-tokenizing")
    parser.add_argument("--turns", default="8,32,128", help="comma-separated turn counts")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens-per-turn", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    turn_counts = [int(t) for t in args.turns.split(",")]

    import torch
    import transformers

    from rl_vllm.generation import VllmGeneration
    from rlcore.config import load_config_dict
    from rlcore.data import BatchedDataDict
    from rlcore.distributed import RayVirtualCluster, shutdown_ray
    from rlcore.models.builtin import BUILTIN_MODELS
    from rlcore.models.cache import tiny_model_path
    from rlcore.tools.calculator import calculator
    from rlcore.tools.schema import function_schema

    transformers.utils.logging.disable_progress_bar()
    tokenizer = chatml_tokenizer()
    model_dir = tiny_model_path(
        **{**BUILTIN_MODELS["tiny-llama"], "vocab_size": 264, "max_position_embeddings": TOKENS_MAX_LEN}
    )
    tools = [function_schema(calculator)]
    prompts = [[{"role": "user", "content": f"compute {100 + 37 * i}*{200 + 53 * i}"}] for i in range(args.samples)]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = load_config_dict(
        {
            "policy": {
                "model_name": model_dir,
                "train_global_batch_size": 1,
                "max_total_sequence_length": TOKENS_MAX_LEN,
                "generation": {
                    "backend": "vllm",
                    "max_new_tokens": args.tokens_per_turn,
                    "temperature": 1.0,
                    "stop_token_ids": [im_end],
                    "pad_token_id": tokenizer.pad_token_id,
                    "vllm_cfg": {"kv_cache_space_gb": 0.5, "max_model_len": TOKENS_MAX_LEN},
                },
            }
        }
    ).policy.generation
    load = os.getloadavg()[0]
    print(
        f"tiny-llama (vocabulary 264, {TOKENS_MAX_LEN} positions); {args.samples} conversations; turns "
        f"{turn_counts}; up to {args.tokens_per_turn} tokens per turn; ChatML with tools; bookkeeping medians of "
        f"{args.repeats} repeats; load average {load:.1f}",
        file=sys.stderr,
    )

    def generate(inputs: list[list[int]]) -> list[list[int]]:
        width = max(len(ids) for ids in inputs)
        batch = torch.full((len(inputs), width), tokenizer.pad_token_id, dtype=torch.long)
        for row, ids in enumerate(inputs):
            batch[row, : len(ids)] = torch.tensor(ids)
        lengths = torch.tensor([len(ids) for ids in inputs])
        out = engine.generate(BatchedDataDict(input_ids=batch, input_lengths=lengths), greedy=False)
        return [
            out["output_ids"][row, n : n + int(g)].tolist()
            for row, (n, g) in enumerate(zip(lengths.tolist(), out["generation_lengths"]))
        ]

    results: dict[int, dict[str, float]] = {}
    cluster = RayVirtualCluster([1], max_colocated_worker_groups=1, name="bench-multi-turn-tokens")
    engine = None
    try:
        engine = VllmGeneration(cluster, cfg, name_prefix="bench-multi-turn-tokens")
        generate([tokens_in_tokens_out(tokenizer, p, tools, [[]])[0] for p in prompts])  # warm-up
        for turns in turn_counts:
            completions: list[list[list[int]]] = [[] for _ in prompts]
            inputs = [tokens_in_tokens_out(tokenizer, p, tools, [[]])[0] for p in prompts]
            engine_s = 0.0
            for turn in range(turns):
                t0 = time.perf_counter()
                outs = generate(inputs)
                engine_s += time.perf_counter() - t0
                for i, out in enumerate(outs):
                    completions[i].append(out)
                    if turn < turns - 1:
                        inputs[i] = [*inputs[i], *out]
                        inputs[i] += appended_ids_for(tokenizer, turn, tools, out)
            sides = {"tito": tokens_in_tokens_out, "retokenize": retokenized}
            seconds: dict[str, list[float]] = {side: [] for side in sides}
            built: dict[str, list[list[list[int]]]] = {}
            for _ in range(args.repeats):
                for side, build in sides.items():
                    t0 = time.perf_counter()
                    built[side] = [build(tokenizer, p, tools, c) for p, c in zip(prompts, completions)]
                    seconds[side].append(time.perf_counter() - t0)
            # tokens-in/tokens-out rebuilt exactly what the engine was given; count the re-tokenized turns that differ
            assert all(ids[-1] == inp for ids, inp in zip(built["tito"], inputs)), "tokens-in/tokens-out replay"
            differ = sum(a != b for tito, re in zip(built["tito"], built["retokenize"]) for a, b in zip(tito, re))
            tito_s, re_s = statistics.median(seconds["tito"]), statistics.median(seconds["retokenize"])
            results[turns] = {
                "tito_s": round(tito_s, 4),
                "retokenize_s": round(re_s, 4),
                "generation_s": round(engine_s, 3),
                "tito_ratio": round(tito_s / engine_s, 4),
                "retokenize_ratio": round(re_s / engine_s, 4),
                "retokenized_turns_differing": differ,
                "turns_compared": sum(len(t) for t in built["tito"]),
                "generated_tokens": sum(len(c) for conv in completions for c in conv),
            }
            print(f"{turns} turns: {results[turns]}", file=sys.stderr, flush=True)
    finally:
        if engine is not None:
            engine.shutdown()
        cluster.shutdown()
        shutdown_ray()

    print(
        f"{'turns':>6}{'tito s':>10}{'retok s':>10}{'gen s':>9}{'tito/gen':>10}{'retok/gen':>11}"
        f"{'retok differs':>15}{'gen tokens':>12}"
    )
    for turns, r in results.items():
        print(
            f"{turns:>6}{r['tito_s']:>10.4f}{r['retokenize_s']:>10.4f}{r['generation_s']:>9.2f}"
            f"{100 * r['tito_ratio']:>9.2f}%{100 * r['retokenize_ratio']:>10.2f}%"
            f"{r['retokenized_turns_differing']:>8}/{r['turns_compared']:<6}{r['generated_tokens']:>12}"
        )
    print(json.dumps({"turns": {str(k): v for k, v in results.items()}, "load": round(os.getloadavg()[0], 1)}))


def appended_ids_for(tokenizer, turn: int, tools, completion: list[int]) -> list[int]:
    from rlcore.chat.templates import appended_ids

    return appended_ids(tokenizer, [tool_message(turn)], tools=tools, completion_ids=completion)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["tokens"]:
        tokens(args[1:])
    else:
        throughput(args[1:] if args[:1] == ["throughput"] else args)


if __name__ == "__main__":
    main()
