"""Graph signatures over the full scheme x clamp x layer-id order x scale-layout matrix."""

import itertools
import subprocess
import sys

import pytest
import torch
from afd_weights import ExpertLayerTensors, GraphSignature, QuantizedExpertWeights, QuantScheme

E, H, INTER, G = 2, 16, 8, 8
SCHEMES = (QuantScheme.W4A8_PER_CHANNEL, QuantScheme.W4A8_PER_GROUP, QuantScheme.W8A8)
CLAMPS = (0.0, 10.0)
LAYER_IDS = {"contiguous": (0, 1, 2), "gapped": (1, 4, 9), "reversed": (2, 1, 0)}
SCALE_LAYOUTS = ("contiguous", "transposed", "gapped")


def _scale(
    shape: tuple[int, ...], dtype: torch.dtype, layout: str, gen: torch.Generator, offset: int
) -> torch.Tensor:
    def rand(*s: int) -> torch.Tensor:
        v = torch.rand(*s, generator=gen) + 0.01
        return v.to(dtype) if dtype.is_floating_point else (v * 1e6).to(dtype)

    if layout == "contiguous":
        return rand(*shape)
    if layout == "transposed":
        return rand(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
    wide = rand(*shape[:-1], 2 * shape[-1] + 1)
    return wide[..., offset : offset + 2 * shape[-1] : 2]


def make_layer(
    scheme: QuantScheme, layer_id: int, layout: str, seed: int, offset: int = 0
) -> ExpertLayerTensors:
    """Random tensors with the scheme's shapes; scales in the requested memory layout."""
    gen = torch.Generator().manual_seed(seed * 1000 + layer_id)
    n13 = 2 * INTER
    if scheme is QuantScheme.W8A8:
        return ExpertLayerTensors(
            layer_id=layer_id,
            w13=torch.randint(-127, 128, (E, H, n13), generator=gen, dtype=torch.int8),
            w2=torch.randint(-127, 128, (E, INTER, H), generator=gen, dtype=torch.int8),
            w13_scale=_scale((E, n13), torch.float32, layout, gen, offset),
            w2_scale=_scale((E, H), torch.float32, layout, gen, offset),
        )
    s13: tuple[int, ...]
    s2: tuple[int, ...]
    if scheme is QuantScheme.W4A8_PER_CHANNEL:
        s13, s2 = (E, n13), (E, H)
    else:
        s13, s2 = (E, H // G, n13), (E, INTER // G, H)
    return ExpertLayerTensors(
        layer_id=layer_id,
        w13=torch.randint(-(2**31), 2**31 - 1, (E, H, n13 // 8), generator=gen, dtype=torch.int32),
        w2=torch.randint(-(2**31), 2**31 - 1, (E, INTER, H // 8), generator=gen, dtype=torch.int32),
        w13_scale=_scale(s13, torch.int64, layout, gen, offset),
        w2_scale=_scale(s2, torch.int64, layout, gen, offset),
        w13_bias=torch.rand(E, n13, generator=gen),
        w2_bias=torch.rand(E, H, generator=gen),
    )


def make_weights(
    scheme: QuantScheme, clamp: float, ids: tuple[int, ...], layout: str, seed: int, offset: int = 0
) -> QuantizedExpertWeights:
    return QuantizedExpertWeights(
        scheme=scheme,
        layers=tuple(make_layer(scheme, i, layout, seed, offset) for i in ids),
        swiglu_limit=clamp,
        routed_scaling_factor=2.5,
        group_size=G if scheme.is_per_group else 0,
    )


CASES = list(itertools.product(SCHEMES, CLAMPS, LAYER_IDS, SCALE_LAYOUTS))


def test_matrix_has_every_case() -> None:
    # 3 schemes x 2 clamps x 3 layer-id orders x 3 scale layouts.
    assert len(CASES) == 54


def test_signature_shared_exactly_within_a_case_and_distinct_across_cases() -> None:
    first: dict[tuple[object, ...], GraphSignature] = {}
    for case in CASES:
        scheme, clamp, ids_name, layout = case
        a = make_weights(scheme, clamp, LAYER_IDS[ids_name], layout, seed=1)
        # Different values, different storage offsets (gapped), different tensor objects.
        b = make_weights(scheme, clamp, LAYER_IDS[ids_name], layout, seed=2, offset=1)
        assert not torch.equal(a.layers[0].w13, b.layers[0].w13)
        assert a.signature == b.signature, case
        assert hash(a.signature) == hash(b.signature)
        assert a.signature.digest() == b.signature.digest()
        first[case] = a.signature
    sigs = list(first.values())
    assert len(set(sigs)) == len(CASES)
    assert len({s.digest() for s in sigs}) == len(CASES)
    # Pairs differing in exactly one dimension never share a signature.
    for c1, c2 in itertools.combinations(CASES, 2):
        if sum(x != y for x, y in zip(c1, c2, strict=True)) == 1:
            assert first[c1] != first[c2], (c1, c2)


def test_signature_records_what_native_ops_depend_on() -> None:
    w = make_weights(QuantScheme.W8A8, 10.0, (2, 1, 0), "transposed", seed=3)
    sig = w.signature
    assert sig.scheme == "w8a8"
    assert sig.swiglu_limit == 10.0
    assert sig.routed_scaling_factor == 2.5
    assert sig.layer_ids == (2, 1, 0)
    layouts = dict(sig.tensor_layouts)
    assert layouts["w13_scale"] is not None
    assert layouts["w13_scale"].stride == (1, E)
    assert layouts["w13"] is not None and layouts["w13"].shape == (E, H, 2 * INTER)
    assert layouts["w13_bias"] is None


def test_routed_scaling_factor_changes_signature() -> None:
    a = make_weights(QuantScheme.W8A8, 0.0, (0, 1), "contiguous", seed=1)
    b = QuantizedExpertWeights(scheme=a.scheme, layers=a.layers, routed_scaling_factor=1.0)
    assert a.signature != b.signature


_CHILD = """
import sys, torch
sys.path.insert(0, {path!r})
from test_weights_signature import make_weights, QuantScheme, LAYER_IDS
for scheme in (QuantScheme.W4A8_PER_CHANNEL, QuantScheme.W4A8_PER_GROUP, QuantScheme.W8A8):
    w = make_weights(scheme, 10.0, LAYER_IDS["gapped"], "gapped", seed=7)
    print(w.signature.digest())
"""


@pytest.mark.timeout(120)
def test_digest_is_identical_in_another_process() -> None:
    import pathlib

    here = str(pathlib.Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD.format(path=here)],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
        timeout=110,
    )
    child = out.stdout.split()
    mine = [
        make_weights(s, 10.0, LAYER_IDS["gapped"], "gapped", seed=99).signature.digest()
        for s in (QuantScheme.W4A8_PER_CHANNEL, QuantScheme.W4A8_PER_GROUP, QuantScheme.W8A8)
    ]
    assert child == mine
