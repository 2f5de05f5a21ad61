"""A tool taskset with a dense reward, for rl-verifiers' GRPO test: the calculator tool of rlv_calc, and a reward a
random tiny model's replies spread over (the fraction of the last reply's characters that are digits)."""

import verifiers.v1 as vf
from rlv_calc import Calculator


class DigitsTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward
    async def digits(self, trace: vf.Trace) -> float:
        reply = trace.last_reply
        return sum(c.isdigit() for c in reply) / len(reply) if reply else 0.0

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(any(not str(m.content).startswith("error") for m in trace.tool_messages))


class DigitsTaskset(vf.Taskset[DigitsTask, vf.TasksetConfig]):
    def load(self):
        yield DigitsTask(vf.TaskData(prompt="Write digits."), self.config.task)


__all__ = ["DigitsTaskset"]
