"""A stand-in generation backend that serves continuously and answers from a script (orchestration tests and the
agent-environment kit, rlcore.testing.agent_kit; never instead of a backend).

A request's completion is the scripted text of its prompt's owner (found by a marker the agent put in its first
message) for the turn the prompt asks for (the number of assistant turns it opens, by the tiny chat template's
``<|assistant|>``; a completions prompt without one: the requests of that owner so far), encoded with the tiny
byte tokenizer, then EOS; token ``k`` of a completion gets logprob ``-(k + 1) / 100``, so a test can tell every
token's logprob apart.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from rlcore.data import BatchedDataDict
from rlcore.interfaces import GenerationInterface


class ScriptedEngine(GenerationInterface):
    """``scripts``: ``{marker: [completion text of turn 0, of turn 1, ...]}``."""

    def __init__(self, tokenizer: Any, scripts: dict[str, list[str]], max_new_tokens: int = 64) -> None:
        self.tokenizer, self.scripts, self.max_new = tokenizer, scripts, max_new_tokens
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    @property
    def continuous_serving(self) -> bool:
        return True

    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        return self.collect(self.generate_async(data, greedy))

    def generate_async(self, data: BatchedDataDict, greedy: bool = False) -> Any:
        prompt = data["input_ids"][0, : int(data["input_lengths"][0])].tolist()
        text = self.tokenizer.decode(prompt)
        with self._lock:
            marker = next(m for m in self.scripts if m in text)
            served = sum(marker in self.tokenizer.decode(r["prompt"]) for r in self.requests)
            turn = text.count("<|assistant|>") - 1 if "<|assistant|>" in text else served
            completion = self.scripts[marker][turn]
            self.requests.append(
                {
                    "prompt": prompt,
                    "greedy": greedy,
                    "seed": int(data["sampling_seeds"][0]) if "sampling_seeds" in data else None,
                    "stop_strings": data.get("stop_strings"),
                }
            )
        ids = self.tokenizer.encode(completion, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        ids, truncated = ids[: self.max_new], len(ids) > self.max_new
        n = len(prompt)
        out: BatchedDataDict[Any] = BatchedDataDict(
            output_ids=torch.tensor([prompt + ids]),
            logprobs=torch.tensor([[0.0] * n + [-(k + 1) / 100 for k in range(len(ids))]]),
            generation_lengths=torch.tensor([len(ids)]),
            unpadded_sequence_lengths=torch.tensor([n + len(ids)]),
            truncated=torch.tensor([truncated]),
            weight_version=torch.tensor([3]),
            generation_window=torch.tensor([[1.0, 2.0]], dtype=torch.float64),
        )
        return out

    def collect(self, handle: Any) -> BatchedDataDict:
        return handle

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        return True
