"""The runtime on real Ray actors and placement groups: cluster, worker group, Policy, failures."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from rlcore.algorithms.loss_functions import NLLLoss
from rlcore.config import ConfigError, load_config_dict
from rlcore.data import BatchedDataDict
from rlcore.distributed import ClusterError, NamedSharding, RayVirtualCluster, WorkerError
from rlcore.distributed.virtual_cluster import _ephemeral_port_floor, _free_port
from rlcore.policy import Policy
from rlcore.testing.models import make_batch
from rlcore.training.logprobs import token_logprobs

# -- named sharding (no Ray) ---------------------------------------------------------------------


def test_named_sharding_layout_is_tp_fastest():
    s = NamedSharding(pp=2, dp=2, cp=1, tp=2)
    assert [s.coords(r)["tp"] for r in range(8)] == [0, 1] * 4
    assert [s.coords(r)["dp"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [s.coords(r)["pp"] for r in range(8)] == [0] * 4 + [1] * 4
    assert all(s.rank(**s.coords(r)) == r for r in range(8))
    assert s.output_ranks() == [0, 2]
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        NamedSharding.for_world(6, tp=4)


# -- cluster -----------------------------------------------------------------------------------------


def test_ports_are_never_handed_out_twice(make_cluster):
    cluster = make_cluster(2)
    ports = [cluster.get_master_address_and_port()[1] for _ in range(25)]
    assert len(set(ports)) == len(ports)
    assert cluster.get_master_address_and_port()[0] == "127.0.0.1"
    # Outside the kernel's ephemeral range, where gloo pairs and client sockets get their ports.
    floor = _ephemeral_port_floor()
    assert floor <= 20000 or all(20000 <= port < floor for port in ports), ports


def test_a_port_someone_listens_on_is_not_handed_out(monkeypatch):
    import rlcore.distributed.virtual_cluster as vc

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        monkeypatch.setattr(vc.random, "sample", lambda population, k: [taken, taken])
        port = _free_port("127.0.0.1")
        assert port != taken
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))


def test_unplaceable_request_fails_with_a_clear_error(ray_session):
    import ray

    before = len(ray.util.placement_group_table())
    start = time.monotonic()
    with pytest.raises(ClusterError, match=r"could not place 64 bundles of \{'CPU': 1.0\} .* within 2s"):
        RayVirtualCluster([64], placement_timeout_s=2).get_placement_group()
    assert time.monotonic() - start < 15
    states = [pg["state"] for pg in ray.util.placement_group_table().values()]
    assert len(states) == before + 1 and states.count("REMOVED") >= 1


def test_colocated_worker_groups_share_bundles(ray_session):
    """Two groups with max_colocated_worker_groups=2 fit on the same two bundles; a third does not."""
    from rlcore.distributed import RayWorkerGroup

    cluster = RayVirtualCluster([2], max_colocated_worker_groups=2, placement_timeout_s=10)
    try:
        sharding = NamedSharding.for_world(2)
        first = RayWorkerGroup(cluster, "collections:Counter", sharding=sharding, name_prefix="train")
        second = RayWorkerGroup(cluster, "collections:Counter", sharding=sharding, name_prefix="gen")
        assert first.worker_pids() and second.worker_pids()  # both groups started inside the bundles
        assert set(first.worker_pids()).isdisjoint(second.worker_pids())
        third = RayWorkerGroup(cluster, "collections:Counter", sharding=sharding, name_prefix="extra")
        import ray

        ready, _ = ray.wait([w.pid.remote() for w in third.workers], num_returns=2, timeout=3)
        assert not ready, "a third group must not fit into bundles shared by two"
        for group in (first, second, third):
            group.shutdown()
    finally:
        cluster.shutdown()


def test_a_signal_inside_a_worker_call_is_a_stop_not_a_worker_failure(ray_session):
    """Ctrl-C landing while the driver waits in Ray's ``wait`` comes out mangled (a ``SystemError`` from
    the C extension, or a failure of the worker being waited on); the stop is still recognised behind it.
    `rlcore run` exited 1 with "worker ... failed: StopRequested" instead of 130 before."""
    from rlcore.distributed import RayWorkerGroup
    from rlcore.run.stopping import StopOnSignals

    cluster = RayVirtualCluster([1], placement_timeout_s=10)
    group = RayWorkerGroup(cluster, "threading:Event", sharding=NamedSharding.for_world(1), name_prefix="waiting")
    signals = StopOnSignals()
    try:
        group.get_results(group.run_all_workers_single_data("is_set"))  # started and answering
        interrupt = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
        with pytest.raises(BaseException) as caught, signals:
            interrupt.start()
            group.get_results(group.run_all_workers_single_data("wait", 5))
        stop = signals.stop_behind(caught.value)
        assert stop is not None and stop.exit_code == 130, repr(caught.value)
        assert StopOnSignals().stop_behind(RuntimeError("a real failure")) is None  # no signal, no stop
    finally:
        group.shutdown()
        cluster.shutdown()


def test_workers_temp_files_go_with_the_private_session(ray_session):
    """A worker library's temp files (megatron-core's checkpoint saver starts a multiprocessing manager that
    leaves a pymp-* dir when its worker is killed) land in the private session's temp dir, which the session
    removes however it ends; the driver's own temp dir and environment are as they were."""
    import tempfile

    import ray

    from rlcore.distributed.ray_runtime import _PRIVATE

    if "temp_dir" not in _PRIVATE:
        pytest.skip("attached to a Ray instance this session did not start")

    @ray.remote(num_cpus=0)
    def worker_temp_dir() -> str:
        return tempfile.gettempdir()

    session_tmp = os.path.join(_PRIVATE["temp_dir"], "tmp")
    assert ray.get(worker_temp_dir.remote()) == session_tmp
    assert not tempfile.gettempdir().startswith(_PRIVATE["temp_dir"])
    assert os.environ.get("TMPDIR") != session_tmp


def test_ray_address_attaches_to_an_existing_cluster(ray_session):
    """With RAY_ADDRESS set, init_ray joins that cluster instead of starting a private one."""
    import ray

    code = (
        "import ray\n"
        "from rlcore.distributed import init_ray\n"
        "started = init_ray()\n"
        "print(started, ray.get_runtime_context().get_node_id())\n"
    )
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    started, node_id = out.stdout.split()[-2:]
    assert started == "False" and node_id == ray.get_runtime_context().get_node_id()


def _listening(pids: set[int]) -> list[str]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("ss is not available")
    return [ln for ln in out.stdout.splitlines() if any(f"pid={pid}," in ln for pid in pids)]


def test_ray_and_workers_listen_on_loopback_only(ray_session, tiny_model_dir, tiny_tokenizer):
    """Ray's own processes and a Policy's ranks (incl. the torch.distributed store) bind loopback only."""
    import ray

    node = ray._private.worker._global_node  # noqa: SLF001 - the processes of this session's Ray
    pids = {info.process.pid for infos in node.all_processes.values() for info in infos}
    cluster = RayVirtualCluster([2])
    policy = Policy(cluster, policy_config(tiny_model_dir), tiny_tokenizer)
    try:
        workers = set(policy.worker_group.worker_pids())
        lines = _listening(pids | workers)
        assert any(f"pid={pid}," in ln for ln in lines for pid in workers), "rank 0 serves the rendezvous store"
        for line in lines:
            assert line.split()[3].startswith(("127.", "[::ffff:127.", "[::1]")), line
    finally:
        policy.shutdown()
        cluster.shutdown()


# -- Policy on the reference backend --------------------------------------------------------


def policy_config(model_dir: str, **policy):
    raw = {
        "cluster": {"workers_per_node": 2},
        "policy": {
            "backend": "reference",
            "model_name": model_dir,
            "train_global_batch_size": 4,
            "train_micro_batch_size": 1,
            "logprob_batch_size": 2,
            "max_grad_norm": None,
            "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}},
            **policy,
        },
    }
    return load_config_dict(raw).policy


def batch(tokenizer, n=4, seed=0) -> BatchedDataDict:
    return BatchedDataDict(make_batch(tokenizer, n, 4, 14, seed=seed))


def hf_logprobs(model, data) -> torch.Tensor:
    ids, lens = data["input_ids"], data["input_lengths"]
    mask = (torch.arange(ids.shape[1])[None] < lens[:, None]).long()
    return token_logprobs(model(input_ids=ids, attention_mask=mask).logits, ids, lens)


@pytest.fixture(scope="module")
def two_rank_policy(ray_session, tiny_model_dir, tiny_tokenizer):
    cluster = RayVirtualCluster([2])
    policy = Policy(cluster, policy_config(tiny_model_dir), tiny_tokenizer)
    yield policy
    policy.shutdown()
    cluster.shutdown()


def test_two_rank_policy_matches_single_process_torch(two_rank_policy, tiny_model_dir, tiny_tokenizer):
    """Logprobs and one SGD step through 2 Ray ranks equal one process doing the same batch."""
    from transformers import AutoModelForCausalLM

    data = batch(tiny_tokenizer, n=4)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = hf_logprobs(model, data)
    got = two_rank_policy.get_logprobs(data)["logprobs"]
    assert got.dtype == torch.float32 and got.shape == data["input_ids"].shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)

    # The single-process reference step: mean NLL over every valid token of the batch.
    valid = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    loss = -(hf_logprobs(model, data)[:, 1:] * valid).sum() / valid.sum()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
        expected_after = hf_logprobs(model, data)

    result = two_rank_policy.train(data, NLLLoss())
    assert result["loss"].shape == (1,)
    assert abs(result["loss"][0].item() - loss.item()) < 1e-5
    assert result["metrics"]["num_valid_tokens"] == valid.sum().item()
    torch.testing.assert_close(two_rank_policy.get_logprobs(data)["logprobs"], expected_after, atol=1e-5, rtol=0)
    # The reference model still holds the initial weights.
    ref = two_rank_policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=0)


def test_results_come_back_in_the_callers_order(two_rank_policy, tiny_tokenizer):
    data = batch(tiny_tokenizer, n=6, seed=3)
    whole = two_rank_policy.get_logprobs(data)["logprobs"]
    reversed_data = data.select_indices(list(range(5, -1, -1)))
    flipped = two_rank_policy.get_logprobs(reversed_data)["logprobs"]
    torch.testing.assert_close(flipped, whole.flip(0), atol=1e-6, rtol=0)


def test_worker_exception_names_the_worker(ray_session, tiny_model_dir, tiny_tokenizer):
    class ExplodingLoss(NLLLoss):
        def __call__(self, *args, **kwargs):
            raise ValueError("loss exploded on purpose")

    cluster = RayVirtualCluster([2])
    policy = Policy(cluster, policy_config(tiny_model_dir), tiny_tokenizer)
    try:
        with pytest.raises(
            WorkerError,
            match=r"worker lm_policy-reference-rank\d \(rank \d\) raised "
            r"ValueError: loss exploded on purpose",
        ):
            policy.train(batch(tiny_tokenizer), ExplodingLoss())
        with pytest.raises(WorkerError, match="unusable after an earlier failure"):
            policy.get_logprobs(batch(tiny_tokenizer))
    finally:
        policy.shutdown()
        cluster.shutdown()


def test_killed_worker_mid_train_raises_promptly(ray_session, tiny_model_dir, tiny_tokenizer):
    cluster = RayVirtualCluster([2])
    policy = Policy(cluster, policy_config(tiny_model_dir, train_global_batch_size=2), tiny_tokenizer)
    try:
        victim = policy.worker_group.worker_pids()[1]
        long_run = batch(tiny_tokenizer, n=4000, seed=1)  # 2000 optimizer steps: far longer than the kill delay
        killed_at: list[float] = []

        def kill() -> None:
            killed_at.append(time.monotonic())
            os.kill(victim, signal.SIGKILL)

        threading.Timer(1.0, kill).start()
        with pytest.raises(WorkerError, match=r"worker lm_policy-reference-rank1 \(rank 1\) died"):
            policy.train(long_run, NLLLoss())
        assert killed_at and time.monotonic() - killed_at[0] < 10
    finally:
        policy.shutdown()
        cluster.shutdown()


def test_shutdown_leaves_no_actor_or_placement_group(ray_session, tiny_model_dir, tiny_tokenizer):
    import ray
    from ray._private.state import actors

    cluster = RayVirtualCluster([2])
    policy = Policy(cluster, policy_config(tiny_model_dir), tiny_tokenizer)
    actor_ids = [w._actor_id.hex() for w in policy.worker_group.workers]
    pg_id = cluster.get_placement_group().id.hex()
    assert policy.shutdown() and cluster.shutdown()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [a for a in actor_ids if actors(a)["State"] != "DEAD"]
        if not alive:
            break
        time.sleep(0.2)
    assert not alive, f"actors still alive after shutdown: {alive}"
    assert ray.util.placement_group_table()[pg_id]["state"] == "REMOVED"


def test_unknown_backend_fails_before_any_worker_starts(ray_session, tiny_model_dir, tiny_tokenizer):
    cfg = policy_config(tiny_model_dir).model_copy(update={"backend": "refrence"})
    cluster = RayVirtualCluster([2])
    try:
        with pytest.raises(ConfigError, match="^policy.backend: no backend named 'refrence'.*did you mean"):
            Policy(cluster, cfg, tiny_tokenizer)
        assert cluster._placement_group is None  # nothing was reserved, nothing started
    finally:
        cluster.shutdown()


@pytest.mark.gpu
def test_two_rank_policy_on_gpus_uses_nccl(tiny_model_dir, tiny_tokenizer):
    """GPU mode: one GPU per bundle, NCCL between ranks; same numbers as on CPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from rlcore.distributed import init_ray

    init_ray(num_gpus=2)
    cluster = RayVirtualCluster([2], use_gpus=True)
    policy = Policy(cluster, policy_config(tiny_model_dir), tiny_tokenizer)
    try:
        assert all(d.startswith("cuda") for d in policy._all("report_device_id"))
        data = batch(tiny_tokenizer, n=4)
        first = policy.get_logprobs(data)["logprobs"]
        result = policy.train(data, NLLLoss())
        assert torch.isfinite(result["loss"]).all()
        assert not torch.allclose(policy.get_logprobs(data)["logprobs"], first)
    finally:
        policy.shutdown()
        cluster.shutdown()
