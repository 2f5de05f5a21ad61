"""``rl_megatron.cpu_compat``: the list of redirected call sites is true, and each redirect behaves.

The end-to-end proof — that a TP=2 / PP=2 run with tied embeddings, activation
checkpointing, clipping and checkpoints redirects no call site outside
:data:`CALL_SITES` — is in ``test_megatron_parallel.py`` (the workers report
what they redirected).
"""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from rl_megatron import cpu_compat

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _function(module_name: str, qualname: str):
    obj = importlib.import_module(module_name)
    for part in qualname.split(".<locals>.")[0].split("."):
        obj = getattr(obj, part)
    return inspect.unwrap(obj)


@pytest.mark.parametrize("site", cpu_compat.CALL_SITES, ids=lambda s: f"{s.module.rsplit('.', 1)[-1]}.{s.function}")
def test_listed_call_site_is_in_the_installed_megatron(site: cpu_compat.CallSite) -> None:
    """Each listed function exists and contains the CUDA use it is listed for (megatron-core 0.16.1)."""
    source = inspect.getsource(_function(site.module, site.function))
    assert site.token in source, f"{site.module}.{site.function} no longer contains {site.token!r}"


def test_redirected_modules_are_those_of_the_call_sites() -> None:
    listed = {s.module for s in cpu_compat.CALL_SITES if s.redirect == "module-local torch"}
    assert set(cpu_compat.REDIRECTED_MODULES) == listed


def test_refuses_to_run_where_cuda_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is available"):
        cpu_compat.apply()
    assert not cpu_compat.is_applied()


_PROBE = textwrap.dedent(r"""
    import json, os, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    from rl_megatron import cpu_compat
    import megatron.core.utils as mutils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    out = {"import_is_inert": mutils.torch is torch and not cpu_compat.is_applied()}

    def attempt(fn):
        try:
            value = fn()
            return {"ok": True, "device": str(value.device)}
        except Exception as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

    rope = lambda: RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)(6)
    buffer = lambda: mutils.GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "x")
    out["before"] = {"rope": attempt(rope), "buffer": attempt(buffer)}
    cpu_compat.apply()
    cpu_compat.apply()  # idempotent
    out["after"] = {"rope": attempt(rope), "buffer": attempt(buffer)}
    out["real_torch_untouched"] = torch.cuda.current_device is not mutils.torch.cuda.current_device

    # The RNG tracker keeps its meaning on the CPU generator: the model-parallel stream is
    # forked off and back, and the default stream continues as if the fork had not happened.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PROBE_PORT"], RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(7)
    state = torch.get_rng_state()
    plain = torch.rand(4)
    torch.set_rng_state(state)
    with get_cuda_rng_tracker().fork():
        forked = torch.rand(4)
    with get_cuda_rng_tracker().fork():
        forked_again = torch.rand(4)
    out["default_stream_continues"] = torch.equal(torch.rand(4), plain)
    out["fork_is_another_stream"] = not torch.equal(forked, plain)
    out["fork_stream_advances"] = not torch.equal(forked, forked_again)
    out["observed"] = cpu_compat.observed_call_sites()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def probe() -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PROBE_PORT": str(port), "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_changes_nothing(probe: dict) -> None:
    assert probe["import_is_inert"]


def test_megatron_needs_the_redirects_on_cpu_and_runs_with_them(probe: dict) -> None:
    for what, result in probe["before"].items():
        assert not result["ok"], f"{what} worked on CPU without the compatibility layer: {result}"
    for what, result in probe["after"].items():
        assert result == {"ok": True, "device": "cpu"}, f"{what}: {result}"
    assert probe["real_torch_untouched"], "torch.cuda itself must not be patched"


def test_rng_tracker_forks_the_cpu_generator(probe: dict) -> None:
    assert probe["default_stream_continues"]
    assert probe["fork_is_another_stream"]
    assert probe["fork_stream_advances"]


def test_probe_redirected_only_listed_call_sites(probe: dict) -> None:
    listed = {(s.module, s.function) for s in cpu_compat.CALL_SITES}
    assert {tuple(site) for site in probe["observed"]} <= listed
