"""The run ``rlcore run`` builds is the :class:`rlcore.interfaces.run.RunContext` algorithms are written against:
every field, property and method the protocol names is there on :class:`rlcore.run.build.Run` (a run that dropped
one would break third-party algorithms, which read nothing else)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

from rlcore.interfaces.run import RunContext
from rlcore.run.build import Run


def protocol_members(protocol: type) -> set[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {
        n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))
    }
    return names


def test_every_member_of_the_protocol_is_on_the_run():
    members = protocol_members(RunContext)
    assert {
        "policy",
        "generation",
        "synchronizer",
        "environment",
        "data",
        "cfg",
        "batch",
        "draw_train_batch",
    } <= members
    plan = SimpleNamespace(global_batch_size=8, micro_batch_size=2, data_parallel_size=2, mode="plain")
    resolved = SimpleNamespace(config=SimpleNamespace(name="cfg"), policy=SimpleNamespace(batch=plan))
    run = Run(resolved, cluster=None)
    missing = [name for name in sorted(members) if not hasattr(run, name)]
    assert not missing, missing
    assert run.cfg is resolved.config and run.batch is plan and run.resolved is resolved


def test_the_run_s_methods_take_what_the_protocol_says():
    for name, member in vars(RunContext).items():
        if name.startswith("_") or not inspect.isfunction(member):
            continue
        assert list(inspect.signature(getattr(Run, name)).parameters) == list(inspect.signature(member).parameters)
