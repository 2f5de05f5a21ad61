"""Refit packing: one fused copy per bucket, the same bytes as a tensor-by-tensor copy, and the sender's
fingerprints are those of the tensors it packed."""

from __future__ import annotations

import pytest
import torch

from rlcore.refit.buckets import RefitError, buffer_bytes, metadata_of, pack, plan_buckets, unpack
from rlcore.refit.fingerprint import Fingerprints, fingerprint


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(50, 16, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.randn(16, generator=g).to(torch.float16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(32, 16, generator=g).t(),  # not contiguous
        "model.layers.1.step": torch.tensor(7, dtype=torch.int64),
        "model.layers.1.mask": torch.tensor([True, False, True]),
        "model.layers.1.empty": torch.zeros(0),
        "lm_head.weight": torch.randn(50, 16, generator=g),
    }


def reference_pack(bucket, named: dict[str, torch.Tensor], size: int) -> torch.Tensor:
    """The bucket as a tensor-by-tensor copy would write it (independent of ``pack``)."""
    out = torch.zeros(size, dtype=torch.uint8)
    for name, offset in zip(bucket.names, bucket.offsets):
        raw = named[name].contiguous().reshape(-1).view(torch.uint8)
        out[offset : offset + raw.numel()] = raw
    return out


@pytest.mark.parametrize("bucket_bytes", [1 << 10, 4 << 10, 1 << 20], ids=["tiny", "layer", "one"])
def test_pack_makes_one_copy_per_bucket_and_the_same_bytes(monkeypatch, bucket_bytes):
    named = tensors()
    metadata = metadata_of(named.items())
    plan = plan_buckets(metadata, bucket_bytes)
    calls = {"foreach": 0, "copy_": 0}
    fused, single = torch._foreach_copy_, torch.Tensor.copy_

    def counting_foreach(*args, **kwargs):
        calls["foreach"] += 1
        return fused(*args, **kwargs)

    def counting_copy(self, *args, **kwargs):
        calls["copy_"] += 1
        return single(self, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_copy_", counting_foreach)
    monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
    stream = iter(named.items())
    buffer = torch.full((buffer_bytes(plan),), 0, dtype=torch.uint8)
    sent = Fingerprints()
    for bucket in plan:
        buffer.zero_()
        before = dict(calls)
        pack(bucket, stream, buffer, metadata, sent)
        assert calls["foreach"] - before["foreach"] == 1, "one fused copy per bucket"
        assert calls["copy_"] == before["copy_"], "no tensor-by-tensor copy"
        monkeypatch.setattr(torch.Tensor, "copy_", single)  # the checks below copy freely
        assert torch.equal(buffer[: bucket.size], reference_pack(bucket, named, bucket.size))
        for name, view in unpack(bucket, buffer, metadata):
            assert torch.equal(view, named[name]), name
        monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
    assert len(plan) > 1 or bucket_bytes == 1 << 20
    assert sent.result() == fingerprint(named.items())  # the sender's fingerprints: the tensors it packed


def test_pack_still_refuses_a_stream_out_of_order():
    named = tensors()
    metadata = metadata_of(named.items())
    plan = plan_buckets(metadata, 1 << 20)
    shuffled = iter(list(named.items())[::-1])
    with pytest.raises(RefitError, match="iteration order must match"):
        pack(plan[0], shuffled, torch.zeros(buffer_bytes(plan), dtype=torch.uint8), metadata)
