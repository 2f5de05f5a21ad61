"""A single-turn verifiers taskset for rl-verifiers' tests: the rubric scores the last reply, two weighted rewards."""

import verifiers.v1 as vf


class QuizData(vf.TaskData):
    answer: str = ""
    difficulty: int = 0


class QuizTask(vf.Task[QuizData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: QuizData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        """1 for a reply of at most 3 characters, weighted 0.5."""
        return float(len(trace.last_reply) <= 3)


class QuizTaskset(vf.Taskset[QuizTask, vf.TasksetConfig]):
    def load(self):
        yield QuizTask(QuizData(prompt="What is 2+2?", answer="4"), self.config.task)


__all__ = ["QuizTaskset"]  # verifiers finds the taskset through __all__


def build_env(agent: dict | None = None) -> vf.Env:
    """This taskset's Env, built by a function (rl-verifiers' 'module:function' form)."""
    seat = agent or {"harness": {"id": "rl_verifiers_harness"}, "runtime": {"type": "subprocess"}}
    return vf.load_environment(vf.resolve_env_config({"taskset": {"id": "rlv_quiz"}, "agent": seat}))


def not_an_env() -> dict:
    return {"taskset": "rlv_quiz"}
