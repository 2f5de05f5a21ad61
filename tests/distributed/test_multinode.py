"""rlcore on a multi-node Ray cluster: two raylets on this machine, attached through ``RAY_ADDRESS``.

The cluster (``rlcore.testing.local_cluster``) has two nodes of 2 CPUs each, so placement is
forced: 4 one-CPU bundles PACKed need both nodes, 2 SPREAD go one per node. Each scenario runs in
a driver subprocess (a process attaches to one Ray cluster), and results are compared with the same
scenario run here on the single-node session Ray. Losing a node runs last: it leaves one node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import multinode_driver

DRIVER = multinode_driver.__file__


@pytest.fixture(scope="module")
def cluster(ray_session: None) -> Iterator[Any]:
    from rlcore.testing.local_cluster import LocalRayCluster

    with LocalRayCluster([2, 2]) as c:
        yield c


def drive(cluster: Any, *args: str, timeout_s: float = 300) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, DRIVER, *args],
        env={**os.environ, **cluster.driver_env()},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return result_of(out.stdout)


def result_of(stdout: str) -> dict[str, Any]:
    lines = [ln for ln in stdout.splitlines() if ln.startswith(multinode_driver.RESULT)]
    assert lines, f"no result line in the driver's output: {stdout[-2000:]}"
    return json.loads(lines[-1].removeprefix(multinode_driver.RESULT))


def installed(backend: str) -> None:
    from rlcore.plugins import get_registry

    if {r.name: r.status for r in get_registry().records}.get(backend) != "ok":
        pytest.skip(f"backend '{backend}' is not installed")


def test_pack_fills_each_node_in_turn_and_spread_uses_both(cluster):
    packed = drive(cluster, "placement", "PACK", "4")["bundles"]
    per_node = Counter(node for node, _ in packed)
    assert sorted(per_node.values()) == [2, 2], packed  # 2 CPUs per node: PACK must span both
    for node in per_node:  # local ranks count within a node, even when nodes share an address
        assert sorted(rank for n, rank in packed if n == node) == [0, 1]
    spread = drive(cluster, "placement", "SPREAD", "2")["bundles"]
    assert len({node for node, _ in spread}) == 2 and [rank for _, rank in spread] == [0, 0]


@pytest.mark.parametrize("backend", ["dtensor", "megatron"])
def test_a_policy_spanning_nodes_trains_like_one_on_a_single_node(cluster, backend, tiny_model_dir):
    installed(backend)
    spanning = drive(cluster, "train", backend, tiny_model_dir, "SPREAD")
    single = multinode_driver.train(backend, tiny_model_dir, "PACK")
    assert spanning["nodes"] == 2 and single["nodes"] == 1
    assert spanning["loss"] == pytest.approx(single["loss"], rel=1e-5)
    import torch

    torch.testing.assert_close(torch.tensor(spanning["logprobs"]), torch.tensor(single["logprobs"]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("transport", ["shared_memory", "collective"])
def test_refit_reaches_engines_on_every_node(cluster, transport, tiny_model_dir):
    installed("vllm")
    result = drive(cluster, "refit", tiny_model_dir, transport)
    assert result["nodes"] == 2
    assert result["max_error"] <= 1e-4, result


def test_losing_a_node_mid_train_names_a_worker_and_frees_the_rest(cluster, tiny_model_dir):
    proc = subprocess.Popen(
        [sys.executable, DRIVER, "lose_a_node", tiny_model_dir],
        env={**os.environ, **cluster.driver_env()},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "TRAINING"
    time.sleep(1.0)
    killed = time.monotonic()
    assert cluster.kill_node(1) > 0
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr[-3000:]
    result = result_of(stdout)
    print(f"node lost mid-train: {result['error']!r} {time.monotonic() - killed:.1f}s after the kill")
    assert result["error"] is not None and "lm_policy-reference-rank" in result["error"]
    assert "died on node" in result["error"]
    assert cluster.node_pids(1) == []
    # The surviving node took its placement back: a 2-bundle group fits there again.
    assert len(drive(cluster, "placement", "PACK", "2")["bundles"]) == 2
