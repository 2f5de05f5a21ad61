"""A batch crosses processes with its CPU tensors as numpy arrays (rlcore.data.wire): the same values come back,
as ordinary writable tensors, through pickle and through a Ray task."""

from __future__ import annotations

import pickle

import pytest
import torch

from rlcore.data import BatchedDataDict
from rlcore.data.wire import NumpyTensor

DTYPES = [torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]


def _batch() -> BatchedDataDict:
    g = torch.Generator().manual_seed(0)
    values = {f"t_{str(d).removeprefix('torch.')}": (torch.randn(3, 5, generator=g) * 50).to(d) for d in DTYPES}
    batch = BatchedDataDict(
        **values,
        mask=torch.rand(3, 5, generator=g) > 0.5,
        bf16=torch.randn(3, 5, generator=g).to(torch.bfloat16),  # numpy has no bfloat16: torch pickles it
        view=torch.arange(30.0).reshape(3, 10)[:, ::2],  # a strided view of a larger storage
        pixel_values=[torch.randn(4, 6, generator=g), torch.zeros(0, 6), torch.randn(2, 6, generator=g)],
        names=["a", "b", "c"],
    )
    batch.micro_batch_indices = [[(0, 2), (2, 3)]]
    batch.micro_batch_lengths = [[5, 5]]
    batch.sample_indices = [2, 0, 1]
    batch.group_size = 3
    batch.seq_key = "t_int64"
    return batch


def _assert_same(got: BatchedDataDict, want: BatchedDataDict) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert type(got[key]) is torch.Tensor and got[key].dtype == value.dtype, key
            assert torch.equal(got[key], value), key
        elif value and isinstance(value[0], torch.Tensor):
            assert all(torch.equal(a, b) for a, b in zip(got[key], value, strict=True)), key
        else:
            assert got[key] == value, key
    for attr in ("micro_batch_indices", "micro_batch_lengths", "sample_indices", "group_size", "seq_key"):
        assert getattr(got, attr) == getattr(want, attr), attr


def test_the_state_holds_numpy_arrays_only_for_what_numpy_holds_exactly():
    batch = _batch()
    batch["grad"] = torch.ones(3, requires_grad=True)
    state = batch.__getstate__()["data"]
    assert all(isinstance(state[f"t_{str(d).removeprefix('torch.')}"], NumpyTensor) for d in DTYPES)
    assert isinstance(state["mask"], NumpyTensor) and isinstance(state["pixel_values"][0], NumpyTensor)
    assert isinstance(state["bf16"], torch.Tensor) and isinstance(state["grad"], torch.Tensor)
    assert state["names"] == ["a", "b", "c"]
    assert isinstance(batch["t_float32"], torch.Tensor)  # the batch itself is untouched


@pytest.mark.parametrize("out_of_band", [False, True])
def test_a_pickled_batch_comes_back_equal_writable_and_apart_from_the_original(out_of_band):
    batch = _batch()
    buffers: list[pickle.PickleBuffer] = []
    blob = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append if out_of_band else None)
    # out of band: each buffer is read-only memory that the receiver does not own (as Ray's object store gives)
    got = pickle.loads(blob, buffers=[bytes(b.raw()) for b in buffers])
    assert bool(buffers) == out_of_band
    _assert_same(got, batch)
    assert got["view"].is_contiguous()
    for key in ("t_float32", "t_int64", "mask"):
        before = batch[key].clone()
        got[key].zero_()  # writable, with its own memory
        assert torch.equal(batch[key], before) and not got[key].any()


def test_a_batch_through_a_ray_actor_is_the_same_batch(ray_session):
    import ray

    @ray.remote(num_cpus=0)
    def add_one(batch: BatchedDataDict) -> BatchedDataDict:
        for key in list(batch):
            if isinstance(batch[key], torch.Tensor) and batch[key].dtype != torch.bool:
                batch[key] += 1  # in place: the received tensors must be writable
        return batch

    batch = _batch()
    batch["big"] = torch.randn(300, 1000)  # 1.2 MB: through the shared object store, not inline
    want = BatchedDataDict(
        {k: v + 1 if isinstance(v, torch.Tensor) and v.dtype != torch.bool else v for k, v in batch.items()}
    )
    want.__dict__.update({k: v for k, v in batch.__dict__.items() if k != "data"})
    _assert_same(ray.get(add_one.remote(batch)), want)
