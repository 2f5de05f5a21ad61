"""The process environment an engine rank sets before its in-process vLLM engine starts (design.md §5).

An engine of ``tensor_parallel_size`` N runs as N engine actors, one per bundle, each holding one rank of
the model in its own process (vLLM's ``external_launcher`` executor: every rank runs the same engine loop on
the same requests, and the ranks meet in a torch.distributed group of their own). Compared with vLLM's
multiprocessing executor, which would spawn the ranks from one actor: each rank is a Ray actor in its own
bundle (its resources are accounted), it starts in a few seconds instead of 20-25, and its model is a plain
module in the actor's process, so a refit loads into it in place exactly as at ``tensor_parallel_size`` 1.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass

from rl_vllm.config import DEFAULT_CPU_KV_CACHE_GB, GIB, VllmConfig
from rlcore.distributed.ray_runtime import pid_alive

#: Set per engine rank: the prefix of its CPU all-reduce segments' names (see :func:`name_segments_uniquely`).
SEGMENT_PREFIX_ENV = "RL_VLLM_SEGMENT_PREFIX"
#: Set by the driver for its engine actors: each rank binds vLLM's IPC sockets in a directory of its own
#: (see :func:`use_private_ipc_dir`).
PRIVATE_IPC_ENV = "RL_VLLM_PRIVATE_IPC_DIR"
#: ``<temp dir>/rlvllm-<pid>``: an engine rank's IPC socket directory, named after its process.
IPC_DIR = re.compile(r"rlvllm-(\d+)")


@dataclass(frozen=True)
class EngineRank:
    """Where one engine actor sits: its rank among all engine ranks, its engine and its rank in that engine."""

    rank: int  # the bundle index: training rank ``rank`` shares its bundle when colocated
    tp_size: int

    @property
    def engine(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size


def omp_threads_bind(engine: EngineRank, threads: int, cpus: list[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for an engine's ranks: ``"0|1"``, one ``|`` entry per rank of the engine.

    Engine rank ``r`` (``engine * tp_size + tp_rank`` over all engines) gets ``threads`` cores of ``cpus`` (the
    cores this process may run on), the next ones after those of rank ``r - 1``, wrapping around when there are
    fewer cores than threads asked for (ranks then share cores, as the bundles of a CPU Ray cluster do).
    """
    entries = []
    for tp_rank in range(engine.tp_size):
        first = (engine.engine * engine.tp_size + tp_rank) * threads
        cores = sorted({cpus[(first + i) % len(cpus)] for i in range(threads)})
        entries.append(",".join(map(str, cores)))
    return "|".join(entries)


def _local_device_index(engine: EngineRank, on_cpu: bool) -> int:
    """The device vLLM's ``external_launcher`` rank uses (``cuda:LOCAL_RANK``): on a GPU actor that Ray gave
    one device (its own ``CUDA_VISIBLE_DEVICES``), that one; otherwise the rank's index. Not yet run on a GPU."""
    if on_cpu:
        return engine.tp_rank
    import torch

    return 0 if torch.cuda.device_count() == 1 else engine.tp_rank


def prepare_process_env(cfg: VllmConfig, on_cpu: bool, engine: EngineRank) -> int | None:
    """Set what the in-process engine reads when it starts; returns the KV cache bytes to ask for (None: vLLM's).

    With ``tensor_parallel_size`` > 1 this is the rank's torch.distributed environment for vLLM's
    ``external_launcher``: the engine's own group (rank = tensor-parallel rank, world = its size), its store
    on the port of the worker group's rendezvous, offset by the engine's index. With ``async_engine`` that store
    also carries the engine loops' ticks (:mod:`rl_vllm.lockstep`).
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # The engine's ranks are on this host: nothing needs to reach them from another one.
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if engine.tp_size > 1:
        port = int(os.environ.get("MASTER_PORT", "29500")) + engine.engine
        os.environ.update(
            RANK=str(engine.tp_rank),
            LOCAL_RANK=str(_local_device_index(engine, on_cpu)),
            WORLD_SIZE=str(engine.tp_size),
            MASTER_PORT=str(port),
        )
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ[SEGMENT_PREFIX_ENV] = f"rlcore-{os.environ['MASTER_ADDR']}-{port}"
    if os.environ.get(PRIVATE_IPC_ENV) == "1" and "VLLM_RPC_BASE_PATH" not in os.environ:
        use_private_ipc_dir()
    if on_cpu:
        if engine.tp_size == 1:
            # Several ranks share few cores: never let the engine pin OpenMP threads to cores.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        else:  # vLLM's CPU workers of several ranks refuse 'nobind' and automatic binding on one NUMA node
            cpus = sorted(os.sched_getaffinity(0))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_threads_bind(engine, cfg.cpu_threads or 1, cpus))
    if cfg.kv_cache_space_gb is not None:
        # vLLM's CPU platform lets this legacy variable (whole GiB) override the size asked for.
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        return cfg.kv_cache_bytes
    if not on_cpu:
        return None
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return None  # the variable sizes it
    # Unset, vLLM's CPU worker would reserve a fraction of all host memory.
    return int(DEFAULT_CPU_KV_CACHE_GB * GIB)


def name_segments_uniquely() -> None:
    """Prefix the names of vLLM's CPU all-reduce segments with this engine's own (``SEGMENT_PREFIX_ENV``).

    vLLM names them from ``VLLM_DIST_IDENT``, which its CPU worker derives from the distributed init method;
    under ``external_launcher`` that is ``env://`` for every engine, so two engines on one host (or two runs)
    would open the same segments, ``-tp:0-[0-1]-cpushm_0``, and all-reduce into each other's.
    """
    prefix = os.environ.get(SEGMENT_PREFIX_ENV)
    if not prefix:
        return
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    if getattr(shm, "_rlcore_prefixed", False):
        return
    original = shm.make_group_name

    def make_group_name(communicator: cpu_communicator.CpuCommunicator) -> str:
        # vLLM's own part starts with the init method's tail, '//' (from 'env://'), which glibc's shm_open drops
        # only at the start of a name: inside one it is an invalid name (EINVAL).
        return f"{os.environ.get(SEGMENT_PREFIX_ENV, '')}{original(communicator).replace('/', '')}"

    shm.make_group_name = staticmethod(make_group_name)  # type: ignore[method-assign]
    shm._rlcore_prefixed = True  # type: ignore[attr-defined]


def unlink_rank_segments() -> list[str]:
    """Remove from /dev/shm the names of the engine's shared-memory segments (design.md §2.9); returns them.

    Two kinds, both mapped by every rank of the engine before ``LLM`` is built here, so their names are no
    longer needed: the mappings stay valid, and the memory goes when the last rank's process ends, however it
    ends (a killed rank's peers are killed with it: rlcore restarts an engine whole):

    - vLLM's CPU all-reduce segments, one per rank (every rank maps all of them in two barriers of its set-up);
    - the ring buffer of each message queue this rank created (the tensor-parallel group's, made by its rank 0
      and opened by the others as the group is built). Python's resource tracker would remove it if the
      process died alone, but Ray ends an actor's child processes with it.
    """
    removed = _unlink_message_queue_buffers()
    prefix = os.environ.get(SEGMENT_PREFIX_ENV)
    if not prefix or not os.path.isdir("/dev/shm"):
        return removed
    for name in os.listdir("/dev/shm"):
        if name.startswith(prefix) and "-cpushm" in name:
            try:
                os.unlink(os.path.join("/dev/shm", name))
                removed.append(name)
            except FileNotFoundError:  # another rank of the engine was first
                pass
    return removed


def _unlink_message_queue_buffers() -> list[str]:
    from vllm.distributed import parallel_state

    removed = []
    for ref in list(parallel_state._groups.values()):
        group = ref()
        queue = getattr(group, "mq_broadcaster", None)
        buffer = getattr(queue, "buffer", None)
        if buffer is None or not getattr(buffer, "is_creator", False):
            continue
        buffer.shared_memory.unlink()  # also tells the resource tracker it is gone
        buffer.is_creator = False  # its finalizer would unlink the name again
        removed.append(buffer.shared_memory.name)
    return removed


def use_private_ipc_dir() -> str:
    """Bind vLLM's IPC sockets in ``<temp dir>/rlvllm-<pid>`` (``VLLM_RPC_BASE_PATH``), after removing the
    directories of engine ranks whose process is gone; returns this rank's.

    vLLM binds ZMQ ``ipc://`` sockets (the message queue of a tensor-parallel group: two unix socket files named
    by a uuid4, made by the group's rank 0) in the temp dir, and removes them when it closes them; a rank that
    is killed leaves them. Named after its process, a killed rank's directory is recognised by the next engine
    rank that starts on the node (the restart of that engine) and removed.
    """
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        match = IPC_DIR.fullmatch(name)
        if match and not pid_alive(int(match.group(1))):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    path = os.path.join(root, f"rlvllm-{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    os.environ["VLLM_RPC_BASE_PATH"] = path
    return path


def remove_own_ipc_dir() -> None:
    """Remove this rank's ``rlvllm-<pid>`` directory (:func:`use_private_ipc_dir`) once its engine is gone."""
    path = os.environ.get("VLLM_RPC_BASE_PATH", "")
    if IPC_DIR.fullmatch(os.path.basename(path)) and os.path.basename(path) == f"rlvllm-{os.getpid()}":
        shutil.rmtree(path, ignore_errors=True)
