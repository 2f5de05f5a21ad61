"""A tool-using verifiers taskset for rl-verifiers' tests: a local MCP toolset (``add``) served by this module.

verifiers starts a task's toolset as ``python -m <its module>`` in the rollout's runtime, hence the ``__main__``.
"""

import verifiers.v1 as vf


class Calculator(vf.Toolset[vf.ToolsetConfig, vf.State]):
    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


class CalcData(vf.TaskData):
    answer: str = ""


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task: CalcData, trace: vf.Trace) -> float:
        return float(task.answer in trace.last_reply)

    @vf.reward(weight=0.25)
    async def used_tool(self, trace: vf.Trace) -> float:
        """1 when a tool answered without an error."""
        return float(any(not str(m.content).startswith("error") for m in trace.tool_messages))


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        yield CalcTask(CalcData(prompt="What is 17+25?", answer="42"), self.config.task)


__all__ = ["CalcTaskset"]

if __name__ == "__main__":
    Calculator.run()
