"""Refit of the slices a tensor-parallel engine rank reads (``rl_vllm.refit.ReadRegions`` and the shared-memory
transport's ``regions``), without vLLM: a loader that narrows, a real socket and real shared buffers.

The end-to-end case (a TP-2 vLLM engine whose logprobs equal the policy's after a refit of regions) is the slow
``test_refit_tp_engines.py``.
"""

from __future__ import annotations

import threading

import pytest
import torch

from rl_vllm.refit import ReadRegions
from rlcore.refit import RefitError, metadata_of
from rlcore.refit.fingerprint import fingerprint


def loaded_tensors() -> dict[str, torch.Tensor]:
    """Views of one buffer, as a transport hands them over."""
    buffer = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    return {
        "q_proj.weight": buffer[:200].view(20, 10),
        "o_proj.weight": buffer[256:456].view(10, 20),
        "norm.weight": buffer[512:522],
        "embed.weight": buffer[600:720].view(30, 4),
        "head.weight": buffer[768:888].view(30, 4),
    }


def test_the_recorder_keeps_the_one_dimension_slices_a_loader_reads() -> None:
    t = loaded_tensors()
    recorder = ReadRegions()
    recorder.track(t.items())
    with recorder.watch():
        torch.empty(10, 10).copy_(t["q_proj.weight"].narrow(0, 10, 10))  # column parallel, rank 1
        torch.empty(10, 10).copy_(t["o_proj.weight"].narrow(1, 10, 10).contiguous())  # row parallel, rank 1
        torch.empty(10).copy_(t["norm.weight"])  # replicated: read whole
        for half in (0, 15):  # two slices that add up to the whole tensor
            torch.empty(15, 4).copy_(t["embed.weight"].narrow(0, half, 15))
        torch.empty(15, 4).copy_(t["head.weight"].narrow(0, 15, 15))
        t["head.weight"].sum()  # any other read of it counts as reading all of it
    assert recorder.regions == {"q_proj.weight": (0, 10, 10), "o_proj.weight": (1, 10, 10)}


def test_reads_outside_the_watch_and_of_untracked_tensors_are_not_recorded() -> None:
    t = loaded_tensors()
    recorder = ReadRegions()
    recorder.track([("q_proj.weight", t["q_proj.weight"])])
    torch.empty(10, 10).copy_(t["q_proj.weight"].narrow(0, 0, 10))  # not watched
    with recorder.watch():
        torch.empty(10, 10).copy_(t["o_proj.weight"].narrow(1, 0, 10))  # not tracked
    assert recorder.regions == {}


def _stream(
    tensors: dict[str, torch.Tensor], regions: dict[str, tuple[int, int, int]], sender_error: list | None = None
):
    """One shared-memory refit from a sender thread to a receiver in this process; returns what each side saw
    (``sender_error`` gets the sender's exception, if any)."""
    from rlcore.refit.fingerprint import Fingerprints
    from rlcore.refit.shared_memory import ShmReceiver, stream_to_receiver

    receiver = ShmReceiver()
    meta = metadata_of(tensors.items())
    sent: list[object] = []

    def send() -> None:
        try:
            sent.append(
                stream_to_receiver(
                    iter(tensors.items()), meta, receiver.address, receiver.authkey, 1024, torch.device("cpu")
                )
            )
        except Exception as exc:  # noqa: BLE001 - checked by the test
            sent.append(exc)
            if sender_error is not None:
                sender_error.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    got: dict[str, torch.Tensor] = {}
    held = Fingerprints()

    def load(named: list[tuple[str, torch.Tensor]]) -> None:
        got.update({n: t.clone() for n, t in named})
        held.add([(n, t.narrow(*regions[n]) if n in regions else t) for n, t in named])

    try:
        stats = receiver.receive(meta, load, timeout_s=60, regions=regions)
    finally:
        thread.join(timeout=60)
        receiver.close()
    return sent[0], stats, got, held.result()


def test_a_refit_of_regions_writes_and_fingerprints_only_the_slices_the_receiver_reads() -> None:
    from rlcore.refit.shared_memory import release_sender_buffers

    release_sender_buffers()  # fresh (zeroed) buffers: what the sender skipped reads as zeros
    source = {name: t.clone() for name, t in loaded_tensors().items()}
    regions = {"q_proj.weight": (0, 10, 10), "o_proj.weight": (1, 0, 10)}
    sent, stats, got, held = _stream(source, regions)
    assert not isinstance(sent, Exception), sent
    for name, t in source.items():
        if name in regions:
            assert torch.equal(got[name].narrow(*regions[name]), t.narrow(*regions[name]))
            assert not torch.equal(got[name], t), f"{name}: the sender wrote more than the receiver reads"
        else:
            assert torch.equal(got[name], t)
    whole = sum(t.numel() * 4 for t in source.values())
    skipped = 100 * 4 + 100 * 4  # half of each 200-element tensor
    assert stats.bytes == int(sent) and whole - skipped <= int(sent) < whole
    # Each side fingerprints what it sent / reads: the slices, as an independent contiguous copy sums them.
    reference = fingerprint([(n, t.narrow(*regions[n]).contiguous() if n in regions else t) for n, t in source.items()])
    assert sent.fingerprints == reference == held
    assert fingerprint([("q_proj.weight", got["q_proj.weight"])]) != {"q_proj.weight": reference["q_proj.weight"]}
    release_sender_buffers()


def test_a_region_outside_its_tensor_is_refused_by_the_sender() -> None:
    with pytest.raises(RefitError):  # the receiver: its sender left before sending its buffers
        _stream(loaded_tensors(), {"q_proj.weight": (0, 15, 10)}, sender_error=(error := []))
    assert isinstance(error[0], RefitError) and "does not fit its shape" in str(error[0])
