"""Pinned launches (bamgen.runtime.triton.launch.pinned): what benchmarks/gpu.py's
bamgen-<prior>@<pins> peers run, a kernel variant timed against the shipped one in one process.
Under the interpreter: the pins are what the kernels launch with (the forward, the decode
kernel and the backward kernels autograd launches, seen by a spy on the prior's kernels), a
variant computes what the shipped kernels compute, nested blocks add up, and a wrong pin is
refused by name."""
from __future__ import annotations

import importlib

import pytest
import torch

from bamgen.runtime.triton.launch import _PINS, pinned, table_gather
from bamgen.runtime.triton.tiles import FWD_TABLE_GATHER
from tests.helpers import gqa_call_grads

GGD = importlib.import_module("generated.generalized_gaussian")


def _call(module, causal=True, n=37, seed=0):
    """A GQA call at a ragged length, its output and every gradient (q, k, v, parameters)."""
    return gqa_call_grads(module, torch.Generator().manual_seed(seed), 1, n, n, causal=causal)


BAM_SSMAX = importlib.import_module("generated.bam_ssmax")


@pytest.mark.parametrize("gather", ["coalesced", "direct", "prefetch"])
@pytest.mark.parametrize("module", [GGD, BAM_SSMAX], ids=["ggd", "bam_ssmax"])
def test_another_table_gather_computes_what_the_shipped_forward_does(gather, module):
    """The forward reading its table entries another way (a copy from pointers of another
    shape; ld.global.nc on a GPU, a plain load under the interpreter) gives the same bits, and
    so the backward's rebuilt P the same gradients; SSMax reads them through its row factors."""
    want = _call(module)
    with pinned(gather=gather):
        assert table_gather() == gather
        got = _call(module)
    assert table_gather() == FWD_TABLE_GATHER   # (the pin ends with the block)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def _layout_call(module, layout, seed=3):
    """A call in one of the layouts a table forward runs (its loops' bounds differ in each): its
    output and every gradient."""
    g = torch.Generator().manual_seed(seed)
    nq, nk, kw = 37, 37, dict(causal=True)
    if layout == "bidirectional":
        kw = dict(causal=False)
    elif layout == "continuation":   # 5 new queries after 32 cached keys
        nq, kw = 5, dict(causal=True, q_offset=32)
    elif layout == "key_mask":
        mask = torch.ones(2, nk, dtype=torch.bool)
        mask[0, :6] = False
        kw = dict(causal=True, key_mask=mask)
    elif layout == "packed":
        cu = torch.tensor([0, 3, 20, 37], dtype=torch.int32)
        kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    elif layout == "positions":   # integer positions: the table read at them (no read ahead)
        pos = torch.sort(torch.randperm(60, generator=g)[:nk]).values.to(torch.float32)[None]
        kw = dict(causal=True, pos_q=pos, pos_k=pos)
    batch = 1 if layout in ("packed", "positions") else 2
    return gqa_call_grads(module, g, batch, nq, nk, **kw)


@pytest.mark.parametrize("layout", ["bidirectional", "continuation", "key_mask", "packed", "positions"])
@pytest.mark.parametrize("module", [GGD, BAM_SSMAX], ids=["ggd", "bam_ssmax"])
def test_the_read_ahead_gives_the_direct_read_s_bits_in_every_layout(module, layout, monkeypatch):
    """"prefetch" reads each key tile's entries one tile ahead (the last clamped to the last
    tile, an empty loop reading the first): the same entries as the direct read, so the same
    bits, where the loops start past the diagonal, stop short of it, skip a document's keys
    or read at integer positions. Under a GPU family's tiles too (BAMGEN_INTERPRET_TILES: its
    64-key tiles, so a 37-key call has one tile and the read ahead its clamp)."""
    for family in (None, "sm_90"):
        if family is None:
            monkeypatch.delenv("BAMGEN_INTERPRET_TILES", raising=False)
        else:
            monkeypatch.setenv("BAMGEN_INTERPRET_TILES", family)
        with pinned(gather="direct"):
            want = _layout_call(module, layout)
        with pinned(gather="prefetch"):
            got = _layout_call(module, layout)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), (family, layout)


class _Spy:
    """A kernel whose launches record their keyword arguments (the constexprs among them)."""

    def __init__(self, kernel, seen):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.seen.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return run


@pytest.mark.parametrize("nq", [37, 1], ids=["forward", "decode"])
def test_the_pinned_gather_is_what_the_kernels_launch_with(nq, monkeypatch):
    """The forward (a prefill) and the decode kernels (one query row, no gradient) are launched
    with the pinned read, and with tiles.FWD_TABLE_GATHER outside the block (the interpreter's
    read: not a GPU family's, BAMGEN_INTERPRET_TILES)."""
    monkeypatch.delenv("BAMGEN_INTERPRET_TILES", raising=False)
    kernels = GGD._prior.kernels().kernels
    name = "fwd" if nq > 1 else "decode"
    seen = []
    monkeypatch.setitem(kernels, name, _Spy(kernels[name], seen))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, nq, 16, generator=g)
    k, v = (torch.randn(1, 1, 40, 16, generator=g) for _ in range(2))
    params = GGD.default_params(2)
    with torch.no_grad():
        want = GGD.attention(q, k, v, causal=True, backend="triton", **params)
        with pinned(gather="coalesced"):
            got = GGD.attention(q, k, v, causal=True, backend="triton", **params)
    assert [s["TABLE_GATHER"] for s in seen] == [FWD_TABLE_GATHER, "coalesced"]
    assert torch.equal(got, want)


@pytest.mark.parametrize("kernel", ["fwd", "bwd_dkdv", "bwd_dq"])
def test_a_pinned_tile_is_the_one_its_kernel_launches_with(kernel, monkeypatch):
    """A tile pinned for one kernel is the one it launches with (the backward's too, launched
    by autograd), the other kernels keep theirs, and the result is the shipped kernels' to
    rounding."""
    want = _call(GGD)
    kernels = GGD._prior.kernels().kernels
    seen = []
    monkeypatch.setitem(kernels, kernel, _Spy(kernels[kernel], seen))
    with pinned(tiles={kernel: (16, 16, 4, 2)}):
        got = _call(GGD)
    assert seen and all((s["BLOCK_M"], s["BLOCK_N"], s["num_warps"], s["num_stages"])
                        == (16, 16, 4, 2) for s in seen), seen
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    seen.clear()
    _call(GGD)   # (outside the block: the interpreter's tile again)
    assert (seen[0]["BLOCK_M"], seen[0]["BLOCK_N"]) != (16, 16)


def test_a_pinned_dq_split_is_what_the_dq_kernel_launches_with(monkeypatch):
    """dq_split=False launches the dQ kernel with one masked loop where the interpreter would
    split off the steady run (and True splits where a GPU family's table would not: GGD at head
    dim 64 on sm_80), with the same bits; outside the block the tile table decides again.
    (What a bamgen-<prior>@dq_split=off peer runs.)"""
    kernels = GGD._prior.kernels().kernels
    seen = []
    monkeypatch.setitem(kernels, "bwd_dq", _Spy(kernels["bwd_dq"], seen))
    want = _call(GGD, n=70)
    with pinned(dq_split=False):
        got = _call(GGD, n=70)
    assert seen and seen[0]["SPLIT_STEADY"] and not any(s["SPLIT_STEADY"] for s in seen[1:]), seen
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    monkeypatch.setenv("BAMGEN_INTERPRET_TILES", "sm_80")
    seen.clear()
    with pinned(dq_split=True):
        with pinned(gather="direct"):   # (an inner block keeps the outer one's split)
            _call(GGD)
    _call(GGD)
    assert [s["SPLIT_STEADY"] for s in seen] == [True, False], seen


def test_a_pinned_dq_group_is_how_many_scalars_each_dq_launch_sums(monkeypatch):
    """dq_group=1 launches GGD's dQ kernel once per learnable scalar (three launches, where the
    interpreter's group of 16 takes one), with gradients within float32 rounding of one
    launch's and dQ's bits; a block inside keeps it. (What bamgen-fire@dq_group=6 runs: FIRE's
    later launches keep 8 bytes of stack at 8 a launch, docs/performance.md, "FIRE's later
    groups".)"""
    monkeypatch.delenv("BAMGEN_INTERPRET_TILES", raising=False)
    kernels = GGD._prior.kernels().kernels
    seen = []
    monkeypatch.setitem(kernels, "bwd_dq", _Spy(kernels["bwd_dq"], seen))
    want = _call(GGD)
    assert [(s["GRAD_BASE"], s["GRAD_COUNT"]) for s in seen] == [(0, 3)]
    seen.clear()
    with pinned(dq_group=1):
        with pinned(gather="direct"):
            got = _call(GGD)
    assert [(s["GRAD_BASE"], s["GRAD_COUNT"]) for s in seen] == [(0, 1), (1, 1), (2, 1)]
    assert torch.equal(got[1], want[1])   # dQ: the first launch's
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6 * float(w.abs().max()))
    assert _PINS.get().dq_group is None


@pytest.mark.parametrize("value", [0, -2, True, 2.0, "6"])
def test_a_dq_group_that_is_not_a_count_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"pinned\(dq_group=...\): .* is not a count of learnable scalars"):
        with pinned(dq_group=value):
            pass


def test_a_block_inside_another_adds_to_its_pins():
    with pinned(tiles={"fwd": (16, 16, 4, 2)}):
        with pinned(gather="coalesced", tiles={"bwd_dq": (16, 16, 4, 1)}):
            assert table_gather() == "coalesced"
            assert _PINS.get().tiles == {"fwd": (16, 16, 4, 2), "bwd_dq": (16, 16, 4, 1)}
        assert table_gather() == FWD_TABLE_GATHER and _PINS.get().tiles == {"fwd": (16, 16, 4, 2)}


@pytest.mark.parametrize("tiles, gather, match", [
    ({"forward": (64, 64, 4, 2)}, None, r"no kernel 'forward'; the kernels are fwd, bwd_dkdv"),
    ({"fwd": (64, 64, 4)}, None, r"fwd=\(64, 64, 4\) is not a tile config"),
    ({"fwd": (64, 64, 4, 0)}, None, r"is not a tile config \(BLOCK_M, BLOCK_N, num_warps"),
    ({"fwd": (24, 16, 4, 1)}, None, r"fwd=\(24, 16, 4, 1\) is not a tile config .* powers of two"),
    ({"decode": (8, 16, 4, 1)}, None, r"decode=\(8, 16, 4, 1\) is not a tile config .* >= 16"),
    ({"fwd": (128, 512, 8, 2)}, None, r"fwd=\(128, 512, 8, 2\) is not a tile config .* <= 256"),
    ({"fwd": (True, 16, 4, 1)}, None, r"is not a tile config"),
    ({"fwd": (64, 64, 32, 2)}, None, r"warps a power of two up to 16"),
    (None, "shared", r"pinned\(gather=...\): 'shared' is not one of async, coalesced, direct, prefetch"),
])
def test_a_wrong_pin_is_refused_by_name(tiles, gather, match):
    with pytest.raises(ValueError, match=match):
        with pinned(tiles, gather):
            pass


@pytest.mark.parametrize("name", ["dq_split", "dkdv_split"])
def test_a_split_that_is_not_a_bool_is_refused_by_name(name):
    with pytest.raises(ValueError, match=rf"pinned\({name}=...\): 'off' is not True or False"):
        with pinned(**{name: "off"}):
            pass
