"""Plugin discovery: statuses end to end with installed fixture plugins, and in-process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import rlcore
from rlcore.plugins import BackendError, BackendSpec, Registry, hookimpl

FIXTURES = Path(__file__).parents[1] / "fixtures" / "plugins"


@pytest.fixture(scope="module")
def fixture_site(tmp_path_factory) -> Path:
    """The fixture distributions, pip-installed into a private directory."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            *(str(p) for p in sorted(FIXTURES.iterdir())),
        ],
        check=True,
    )
    return target


def run_cli(site: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]), **env}
    for var in ("RLCORE_PLUGINS", "RLCORE_DISABLE_PLUGINS"):
        if var not in env:
            environ.pop(var, None)
    return subprocess.run([sys.executable, "-m", "rlcore", *args], capture_output=True, text=True, env=environ)


def rows_by_name(result: subprocess.CompletedProcess) -> dict[str, dict]:
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["backends"]
    for row in rows:
        assert set(row) == {
            "name",
            "kind",
            "plugin",
            "distribution",
            "version",
            "status",
            "capabilities",
            "plugin_api_version",
            "problem",
        }
    return {(r["name"], r["distribution"]): r for r in rows}


def test_list_json_shows_every_status(fixture_site):
    rows = rows_by_name(run_cli(fixture_site, "backends", "list", "--json"))
    ok = rows[("fixture_ok", "rlcore-fixture-ok")]
    assert ok["status"] == "ok" and ok["version"] == "1.2.3" and ok["capabilities"] == ["logprobs", "train"]
    unavailable = rows[("fixture_unavailable", "rlcore-fixture-ok")]
    assert unavailable["status"] == "unavailable"
    assert "pip install rlcore-engine-that-is-not-installed" in unavailable["problem"]
    import rlcore

    incompatible = rows[("fixture_future", "rlcore-fixture-future")]  # its distribution requires rlcore>=99
    assert incompatible["status"] == "incompatible"
    assert incompatible["problem"] == f"requires rlcore>=99, this is {rlcore.__version__}: upgrade rlcore"
    broken = rows[("fixture_broken", "rlcore-fixture-broken")]
    assert broken["status"] == "broken" and "rlcore_module_that_does_not_exist" in broken["problem"]
    dup_a, dup_b = rows[("fixture_dup", "rlcore-fixture-ok")], rows[("fixture_dup", "rlcore-fixture-dup")]
    assert dup_a["status"] == dup_b["status"] == "conflict"
    assert "rlcore-fixture-dup:fixture_dup" in dup_a["problem"]
    assert not {"fixture_env", "fixture_future_env"} & {name for name, _ in rows}  # environments: their own list


def test_environments_list_shows_environments_and_broken_plugins(fixture_site):
    import rlcore

    result = run_cli(fixture_site, "environments", "list", "--json")
    assert result.returncode == 0, result.stderr
    rows = {(r["name"], r["distribution"]): r for r in json.loads(result.stdout)["environments"]}
    assert rows[("fixture_env", "rlcore-fixture-ok")]["status"] == "ok"
    assert rows[("math", "rlcore")]["status"] == "ok"
    assert rows[("fixture_future_env", "rlcore-fixture-future")]["problem"] == (
        f"requires rlcore>=99, this is {rlcore.__version__}: upgrade rlcore"
    )
    assert rows[("fixture_broken", "rlcore-fixture-broken")]["status"] == "broken"  # it may have provided one
    assert not any(name.startswith("fixture_") and name.endswith(("ok", "dup", "unavailable")) for name, _ in rows)
    table = run_cli(fixture_site, "environments", "list")
    assert "fixture_env" in table.stdout and "-> requires rlcore>=99" in table.stdout
    shown = run_cli(fixture_site, "environments", "show", "fixture_env")
    assert shown.returncode == 0 and "environment_class: rlcore_fixture_ok.worker:Worker" in shown.stdout
    refused = run_cli(fixture_site, "backends", "list", "--kind", "environment")
    assert refused.returncode != 0 and "rlcore environments list" in refused.stderr


def test_algorithms_list_shows_the_builtins_apart_from_backends(fixture_site):
    result = run_cli(fixture_site, "algorithms", "list", "--json")
    assert result.returncode == 0, result.stderr
    rows = {r["name"]: r for r in json.loads(result.stdout)["algorithms"]}
    assert {name: (r["distribution"], r["status"]) for name, r in rows.items() if r["distribution"] == "rlcore"} == {
        name: ("rlcore", "ok") for name in ("grpo", "sft", "dpo", "ppo", "distillation", "rm")
    }
    backends = rows_by_name(run_cli(fixture_site, "backends", "list", "--json"))
    assert {"reference", "dtensor"} <= {name for name, _ in backends} and not {name for name, _ in backends} & set(rows)
    shown = run_cli(fixture_site, "algorithms", "show", "dpo")
    assert shown.returncode == 0 and "algorithm_class: rlcore.algorithms.dpo.loop:DPO" in shown.stdout
    missing = run_cli(fixture_site, "algorithms", "show", "trpo")
    assert missing.returncode == 1 and "no algorithm named 'trpo'" in missing.stderr


def test_list_table_and_kind_filter(fixture_site):
    result = run_cli(fixture_site, "backends", "list", "--kind", "generation")
    assert result.returncode == 0, result.stderr
    assert "fixture_unavailable" in result.stdout and "fixture_ok " not in result.stdout
    assert "-> missing rlcore_engine_that_is_not_installed" in result.stdout


def test_allow_and_deny_lists(fixture_site):
    rows = rows_by_name(run_cli(fixture_site, "backends", "list", "--json", RLCORE_PLUGINS="fixture_dup"))
    statuses = {key: r["status"] for key, r in rows.items() if key[1].startswith("rlcore-fixture")}
    assert statuses[("fixture_dup", "rlcore-fixture-dup")] == "ok"  # its rival is disabled
    assert statuses[("fixture_ok", "rlcore-fixture-ok")] == "disabled"
    assert statuses[("fixture_broken", "rlcore-fixture-broken")] == "disabled"

    rows = rows_by_name(run_cli(fixture_site, "backends", "list", "--json", RLCORE_PLUGINS=""))
    assert all(r["status"] == "disabled" for r in rows.values())

    rows = rows_by_name(
        run_cli(fixture_site, "backends", "list", "--json", RLCORE_DISABLE_PLUGINS="rlcore-fixture-broken")
    )
    assert rows[("fixture_broken", "rlcore-fixture-broken")]["status"] == "disabled"
    assert rows[("fixture_ok", "rlcore-fixture-ok")]["status"] == "ok"


def test_show_names_the_problem(fixture_site):
    result = run_cli(fixture_site, "backends", "show", "fixture_unavailable")
    assert result.returncode == 0
    assert "status: unavailable" in result.stdout and "install_hint:" in result.stdout
    result = run_cli(fixture_site, "backends", "show", "fixture_okk")
    assert result.returncode == 1 and "did you mean 'fixture_ok'" in result.stderr


def test_listing_imports_no_heavy_module(fixture_site):
    code = (
        "import sys, io, contextlib\n"
        "from rlcore.cli.app import app\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try: app(['backends', 'list'])\n"
        "    except SystemExit: pass\n"
        "heavy = [m for m in ('torch', 'ray', 'vllm', 'megatron', 'transformers', 'numpy') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(fixture_site)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "", f"'rlcore backends list' imported {out.stdout.strip()}"


# -- in-process: plugin objects registered without installing them -------------------------


class OkPlugin:
    @hookimpl
    def rlcore_register_backends(self, register):
        register(BackendSpec(name="mine", kind="training", worker_class="collections:Counter", capabilities={"train"}))


class RaisingPlugin:
    @hookimpl
    def rlcore_register_backends(self, register):
        raise RuntimeError("boom in hook")


def test_register_plugin_object_and_resolve():
    registry = Registry()
    registry.register_plugin(OkPlugin(), name="ok")
    registry.register_plugin(RaisingPlugin(), name="raising")
    assert registry.resolve("mine").worker_class == "collections:Counter"
    assert [r.status for r in registry.records] == ["ok", "broken"]
    assert "boom in hook" in registry.records[1].problem
    with pytest.raises(BackendError, match="is a training backend, not a generation backend"):
        registry.resolve("mine", kind="generation")
    with pytest.raises(BackendError, match="did you mean 'mine'"):
        registry.resolve("mien")


def test_conflict_is_resolvable_by_distribution():
    registry = Registry()
    registry.register_plugin(OkPlugin(), name="a", distribution="dist-a")
    registry.register_plugin(OkPlugin(), name="b", distribution="dist-b")
    with pytest.raises(BackendError, match="conflict.*select one as"):
        registry.resolve("mine")
    assert registry.resolve("dist-b:mine").name == "mine"


def test_unavailable_and_incompatible_fail_with_the_fix():
    class Plugin:
        @hookimpl
        def rlcore_register_backends(self, register):
            register(
                BackendSpec(
                    name="needs_engine",
                    kind="generation",
                    worker_class="collections:Counter",
                    requires=("no_such_engine_mod",),
                    install_hint="pip install engine",
                )
            )

    class Future:
        @hookimpl
        def rlcore_register_backends(self, register):
            register(
                BackendSpec(name="future", kind="training", worker_class="collections:Counter", plugin_api_version=7)
            )  # means nothing: its distribution says what it needs

    registry = Registry()
    registry.register_plugin(Plugin(), name="p", requires=["torch", "rlcore[hf]"])
    registry.register_plugin(Future(), name="f", distribution="rl-future", requires=["rlcore>=0.1, <0.1.0"])
    with pytest.raises(BackendError, match="unavailable: missing no_such_engine_mod: pip install engine"):
        registry.resolve("needs_engine")
    this = re.escape(rlcore.__version__)
    with pytest.raises(
        BackendError,
        match=rf"backend 'future' is incompatible: requires rlcore<0.1.0,>=0.1, this is "
        rf"{this}: install a release of rl-future made for rlcore {this}",
    ):
        registry.resolve("future")


def test_a_plugin_that_fails_to_load_under_an_older_rlcore_says_so():
    """A plugin written for a newer rlcore most likely fails on an import this one lacks: the requirement is the
    cause worth naming."""
    from rlcore.plugins.requirements import rlcore_requirement_problem

    assert rlcore_requirement_problem(["rlcore>=99"], installed="0.1.0") == (
        "requires rlcore>=99, this is 0.1.0: upgrade rlcore"
    )
    assert rlcore_requirement_problem(["rlcore==0.3.*"], installed="0.2.5") == (
        "requires rlcore==0.3.*, this is 0.2.5: upgrade rlcore"
    )
    assert rlcore_requirement_problem(["rlcore>=99; extra == 'test'", "rlcore>=0.1"], installed="0.1.0") == ""
    assert rlcore_requirement_problem(["rlcore>=0.2.0.dev0"], installed="0.2.0rc1") == ""

    class Dist:
        name, version, requires = "rl-next", "3.0", ["rlcore>=99"]

    class EntryPoint:
        name, dist = "next", Dist()

        def load(self):
            from rlcore.plugins import NameFromTheFuture  # noqa: F401

    registry = Registry()
    registry.load_entry_points([EntryPoint()])
    (record,) = registry.records
    assert record.status == "incompatible"
    assert record.problem.startswith("requires rlcore>=99, this is ")
    assert "upgrade rlcore (loading it failed: ImportError: cannot import name 'NameFromTheFuture'" in record.problem


def test_broken_entry_point_does_not_hide_the_others():
    good = metadata.EntryPoint(name="good", value=f"{__name__}:GOOD_PLUGIN", group="rlcore.plugins")
    bad = metadata.EntryPoint(name="bad", value="rlcore_no_such_module_xyz", group="rlcore.plugins")
    registry = Registry()
    registry.load_entry_points([bad, good])
    assert {r.name: r.status for r in registry.records} == {"bad": "broken", "mine": "ok"}


GOOD_PLUGIN = OkPlugin()


@pytest.mark.parametrize(
    "bad",
    [
        dict(name="", kind="training", worker_class="collections:Counter"),
        dict(name="x", kind="trainer", worker_class="collections:Counter"),
        dict(name="x", kind="training", worker_class="a.B"),
    ],
)
def test_backend_spec_rejects_bad_fields(bad):
    with pytest.raises(ValueError):
        BackendSpec(**bad)


def test_backend_spec_is_frozen():
    spec = BackendSpec(name="x", kind="training", worker_class="collections:Counter")
    with pytest.raises(ValueError):
        spec.name = "y"


def test_third_party_config_section_is_validated_by_its_own_class(rlcore_registry):
    from rlcore.config import ConfigError, load_config_dict, resolve

    class Plugin:
        @hookimpl
        def rlcore_register_backends(self, register):
            register(
                BackendSpec(
                    name="mine",
                    kind="training",
                    worker_class="collections:Counter",
                    config_class="tests.fixtures.third_party_config:MineConfig",
                )
            )

    rlcore_registry.register_plugin(Plugin(), name="p")
    good = resolve(load_config_dict({"policy": {"backend": "mine", "mine_cfg": {"shards": 2}}}))
    assert good.policy.section.shards == 2 and type(good.policy.section).__name__ == "MineConfig"
    bad = load_config_dict({"policy": {"backend": "mine", "mine_cfg": {"shards": "many", "colour": 1}, "mein_cfg": {}}})
    with pytest.raises(ConfigError) as caught:
        resolve(bad)
    problems = caught.value.problems
    assert any(p.startswith("policy.mine_cfg.shards:") and "'many'" in p for p in problems), problems
    assert any(p.startswith("policy.mine_cfg.colour: unknown key") for p in problems), problems
    assert any(
        p.startswith("policy.mein_cfg: no installed backend named 'mein'; did you mean 'mine_cfg'") for p in problems
    ), problems


def test_backend_whose_worker_module_is_missing_is_broken():
    class Plugin:
        @hookimpl
        def rlcore_register_backends(self, register):
            register(BackendSpec(name="ghost", kind="training", worker_class="rlcore_no_such_pkg.worker:W"))

    registry = Registry()
    registry.register_plugin(Plugin(), name="p", distribution="ghost-dist")
    with pytest.raises(BackendError, match="broken: worker module of rlcore_no_such_pkg.worker:W is not installed"):
        registry.resolve("ghost")


def test_workers_get_their_own_section_validated():
    """What Policy hands a worker as ``backend_config``: a declared section as is, a collected one
    validated with the backend's config class, an invalid one refused by dotted path."""
    from rlcore.config import ConfigError, load_config
    from rlcore.config.backends import own_section
    from rlcore.plugins import get_registry

    registry = get_registry()
    cfg = load_config("examples/grpo_tiny.yaml", ["policy.dtensor_cfg.tensor_parallel_size=2"])
    dtensor = registry.resolve("dtensor", kind="training")
    assert own_section(dtensor, cfg.policy, "policy").tensor_parallel_size == 2  # validated by rl_dtensor.config
    assert own_section(registry.resolve("reference", kind="training"), cfg.policy, "policy") is None

    vllm = registry.resolve("vllm", kind="generation")
    gen = load_config("examples/grpo_tiny.yaml", ["policy.generation.vllm_cfg.max_model_len=48"]).policy.generation
    section = own_section(vllm, gen, "policy.generation")
    assert type(section).__name__ == "VllmConfig" and section.max_model_len == 48
    assert own_section(vllm, cfg.policy.generation, "policy.generation") == type(section)()  # absent: defaults
    bad = load_config("examples/grpo_tiny.yaml", ["policy.generation.vllm_cfg.tensor_paralel_size=2"]).policy.generation
    with pytest.raises(ConfigError) as caught:
        own_section(vllm, bad, "policy.generation")
    assert caught.value.problems[0].startswith("policy.generation.vllm_cfg.tensor_paralel_size: unknown key")
