"""Verified refit: fingerprints, the kit's corrupting backend, and a real shared-memory refit checked end to end."""

from __future__ import annotations

import pytest
import torch

from rlcore.plugins import Capability
from rlcore.refit import RefitError
from rlcore.refit.fingerprint import (
    SAMPLES,
    check_fingerprints,
    fingerprint,
    sample_indices,
    tensor_fingerprint,
    verify_engines,
)
from rlcore.testing.conformance.verified_refit import CorruptingEngines, FakeEngines, verified_refit_problems


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "embed.weight": torch.randn(1000, 64, generator=g),  # large: sampled
        "layer.0.bias": torch.randn(7, generator=g).to(torch.bfloat16),  # small: summed whole
        "layer.0.weight": torch.randn(300, 40, generator=g).to(torch.float16),
        "steps": torch.tensor(3, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def test_equal_tensors_give_equal_fingerprints_and_copies_agree():
    a = fingerprint(weights().items())
    b = fingerprint((n, t.clone()) for n, t in weights().items())
    assert a == b and set(a) == set(weights())
    check_fingerprints(a, b, engine="engine 0")


def test_the_sample_covers_the_first_and_last_element_at_a_fixed_stride():
    index = sample_indices(64_000)
    assert int(index[0]) == 0 and int(index[-1]) == 63_999 and len(index) == SAMPLES + 2
    steps = index[1:-1].diff()
    assert bool((steps == steps[0]).all())
    assert sample_indices(10).tolist() == list(range(10))  # few elements: all of them


@pytest.mark.parametrize("name", sorted(weights()))
@pytest.mark.parametrize("where", ["first", "last", "sampled"])
def test_one_changed_element_is_named(name, where):
    sent = weights()
    held = {n: t.clone() for n, t in sent.items()}
    flat = held[name].view(-1)
    index = sample_indices(flat.numel())
    position = {"first": 0, "last": flat.numel() - 1, "sampled": int(index[len(index) // 2])}[where]
    flat[position] = ~flat[position] if flat.dtype == torch.bool else flat[position] + 1
    with pytest.raises(RefitError) as err:
        check_fingerprints(fingerprint(sent.items()), fingerprint(held.items()), engine="engine 1", bucket_of={name: 2})
    line = str(err.value)
    assert "\n" not in line and f"'{name}' (bucket 2)" in line and "engine 1" in line


def test_whole_tensor_faults_are_caught_between_samples():
    t = weights()["embed.weight"]
    base = tensor_fingerprint(t)
    assert tensor_fingerprint(torch.zeros_like(t)) != base
    assert tensor_fingerprint(t * 2) != base
    assert tensor_fingerprint(t.roll(1)) != base
    assert tensor_fingerprint(t[:-1]) != base
    assert tensor_fingerprint(t.double()) != base
    # a full pass (samples=None) catches one changed element anywhere
    u = t.clone()
    u.view(-1)[5] += 1
    assert tensor_fingerprint(u, samples=None) != tensor_fingerprint(t, samples=None)


def test_a_wrong_or_missing_version_is_one_line():
    sent = fingerprint(weights().items())
    with pytest.raises(RefitError, match=r"^refit verification failed: engine 0 holds weight_version 2, expected 3$"):
        verify_engines(sent, [{"weight_version": 2, "fingerprints": sent}], version=3)
    assert verify_engines(sent, [{"weight_version": 3, "fingerprints": sent}] * 2, version=3) == 3


def test_capability_is_declared_in_the_enum():
    assert Capability("verified_refit") is Capability.VERIFIED_REFIT


def test_kit_passes_an_honest_backend_and_catches_one_corrupted_tensor():
    named = list(weights().items())
    assert verified_refit_problems(FakeEngines(), named) == []
    problems = verified_refit_problems(CorruptingEngines("layer.0.weight"), named, version=4)
    assert len(problems) == 1 and "\n" not in problems[0]
    assert problems[0].startswith("refit verification failed: engine 1 holds fingerprint")
    assert "tensor 'layer.0.weight'" in problems[0]


def test_a_real_shared_memory_refit_is_verified():
    """The colocated transport's real receiver (a spawned sender process, no Ray): what it loaded matches."""
    from tests.refit.test_refit import _receive_shm, sample_tensors

    got: dict[str, torch.Tensor] = {}
    _, (status, _) = _receive_shm(got)
    assert status == "ok"
    sent = fingerprint(sample_tensors().items())
    verify_engines(sent, [{"weight_version": 1, "fingerprints": fingerprint(got.items())}], version=1)
    got["big.weight"].view(-1)[-1] += 1
    with pytest.raises(RefitError, match="tensor 'big.weight'"):
        verify_engines(sent, [{"weight_version": 1, "fingerprints": fingerprint(got.items())}], version=1)


@pytest.mark.parametrize("setting, decided", [(None, True), ("false", False), ("true", True)])
def test_verify_refit_is_decided_by_the_setting_and_the_engine_s_capability(setting, decided):
    from rlcore.config import load_config
    from rlcore.config.resolve import resolve

    overrides = [] if setting is None else [f"policy.generation.verify_refit={setting}"]
    resolved = resolve(load_config("examples/grpo_tiny.yaml", overrides), run=True)
    assert resolved.generation.spec.supports(Capability.VERIFIED_REFIT)  # vllm declares it
    assert resolved.generation.verify_refit is decided


def test_verify_refit_required_without_a_refit_is_one_line():
    from rlcore.config import load_config
    from rlcore.config.errors import ConfigError
    from rlcore.config.resolve import resolve

    with pytest.raises(ConfigError) as caught:
        resolve(load_config("examples/grpo_fsdp1.yaml", ["policy.generation.verify_refit=true"]), run=True)
    assert caught.value.problems == [
        "policy.generation.verify_refit: is true, but the training backend generates itself and no refit happens; "
        "remove it, or set policy.generation.backend to an engine (e.g. vllm)"
    ]


def _by_definition(tensor: torch.Tensor, samples: int | None = SAMPLES) -> int:
    """The checksum recomputed element by element in Python from the module's stated definition."""
    import struct

    flat = tensor.reshape(-1)
    width = flat.element_size()
    raw = flat.to(torch.uint8) if flat.dtype == torch.bool else flat
    code = {1: "b", 2: "h", 4: "i", 8: "q"}[width]
    total = 0
    for position in sample_indices(flat.numel(), samples).tolist():
        element = raw[position : position + 1].contiguous()
        bits = struct.unpack(code, bytes(element.view(torch.uint8).tolist()))[0]
        total += bits * (2 * position + 1)
    total = (total + (1 << 63)) % (1 << 64) - (1 << 63)  # wrapping int64
    return (total * 1_000_003 + flat.numel() * 31 + width) & ((1 << 64) - 1)


def test_checksums_added_bucket_by_bucket_equal_the_definition() -> None:
    """Mixed dtypes and sizes, in two adds (two buckets), the strided views and one vectorised sum give
    each tensor the checksum the definition gives it alone; a full pass too."""
    from rlcore.refit.fingerprint import Fingerprints

    g = torch.Generator().manual_seed(3)
    tensors = [
        ("big", torch.randn(4099, generator=g)),
        ("bf16", torch.randn(70, 9, generator=g).bfloat16()),
        ("ints", torch.randint(-5, 5, (67,), generator=g)),
        ("mask", torch.rand(80, generator=g) > 0.5),
        ("small", torch.randn(3, generator=g).half()),
        ("empty", torch.randn(0)),
        ("strided", torch.randn(40, 130, generator=g).t()),
    ]
    for samples in (SAMPLES, 8, None):
        acc = Fingerprints(samples)
        acc.add(tensors[:3])
        acc.add(tensors[3:])
        assert acc.result() == {name: _by_definition(t, samples) for name, t in tensors}, samples


def test_one_element_in_the_middle_of_a_large_tensor() -> None:
    """A single changed element in the middle of a 4M-element tensor, as the kit's corrupting engine makes.

    Detected: the change is caught and named when the element is one the strided sample reads (the
    middle sampled position here), and always by a full pass (``samples=None``). Not detected, by design:
    a change to one element *between* two samples, the price of summing 66 elements, not 4M. The last
    assertion pins that limit, so a change to what is sampled shows up here rather than in a refit."""
    g = torch.Generator().manual_seed(5)
    sent = {"big.weight": torch.randn(2048, 2048, generator=g), "small.bias": torch.randn(5, generator=g)}
    index = sample_indices(sent["big.weight"].numel()).tolist()
    middle = index[len(index) // 2]
    assert abs(middle - sent["big.weight"].numel() // 2) < index[2] - index[1]  # the sample reaches the middle

    def held_with(position: int) -> dict[str, torch.Tensor]:
        held = {n: t.clone() for n, t in sent.items()}
        held["big.weight"].view(-1)[position] += 1
        return held

    with pytest.raises(
        RefitError,
        match=r"^refit verification failed: engine 0 holds fingerprint 0x[0-9a-f]{16} for "
        r"tensor 'big\.weight' \(bucket 3\); the trainer sent 0x[0-9a-f]{16}$",
    ):
        check_fingerprints(
            fingerprint(sent.items()),
            fingerprint(held_with(middle).items()),
            engine="engine 0",
            bucket_of={"big.weight": 3, "small.bias": 3},
        )
    between = middle + 1  # not a sampled position
    assert between not in index
    full_sent, full_held = (
        fingerprint(sent.items(), samples=None),
        fingerprint(held_with(between).items(), samples=None),
    )
    assert full_sent["big.weight"] != full_held["big.weight"] and full_sent["small.bias"] == full_held["small.bias"]
    assert fingerprint(held_with(between).items()) == fingerprint(sent.items())  # the stated blind spot


def test_views_of_one_buffer_are_gathered_with_the_same_checksums() -> None:
    """A receiver's bucket: tensors of several dtypes packed into one uint8 buffer and unpacked as views (the
    one-gather path), plus a transposed view of it and a separate tensor (the strided-view path): each
    checksum equals the definition's, and a copied buffer gives the same; one changed byte of a sampled
    element names its tensor."""
    from rlcore.refit.fingerprint import Fingerprints, _storage_positions

    g = torch.Generator().manual_seed(4)
    tensors = [
        ("w", torch.randn(300, 41, generator=g)),
        ("bf16", torch.randn(5000, generator=g).bfloat16()),
        ("ints", torch.randint(-9, 9, (129,), generator=g)),
        ("mask", torch.rand(90, generator=g) > 0.5),
        ("tiny", torch.randn(2, generator=g)),
        ("bf16.b", torch.randn(77, generator=g).bfloat16()),
    ]
    buffer, views, offset = torch.zeros(1 << 18, dtype=torch.uint8), [], 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        buffer[offset : offset + n].copy_(t.reshape(-1).view(torch.uint8))
        views.append((name, buffer[offset : offset + n].view(t.dtype).view(t.shape)))
        offset += -(-n // 64) * 64
    views.append(("w.t", views[0][1].t()))  # same storage, not contiguous
    views.append(("alone", torch.randn(1000, generator=g)))
    expected = {name: _by_definition(t) for name, t in views}
    acc = Fingerprints()
    layouts = _storage_positions.cache_info().currsize
    acc.add(views)
    assert _storage_positions.cache_info().currsize == layouts + 2  # float32 and bfloat16 gathered
    assert acc.result() == expected == fingerprint(views)
    copy = buffer.clone()  # the other receive buffer: same offsets
    unpacked = views[:6]
    assert fingerprint(
        [
            (
                n,
                copy[t.storage_offset() * t.element_size() :][: t.numel() * t.element_size()]
                .view(t.dtype)
                .view(t.shape),
            )
            for n, t in unpacked
        ]
    ) == {n: expected[n] for n, _ in unpacked}
    position = sample_indices(views[1][1].numel())[10].item() * 2  # a byte of a sampled bf16 element
    buffer[views[1][1].storage_offset() * 2 + position] ^= 1
    with pytest.raises(RefitError, match=r"tensor 'bf16'"):
        check_fingerprints(expected, fingerprint(views), engine="engine 0")
