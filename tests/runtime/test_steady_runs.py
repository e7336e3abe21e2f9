"""The backward kernels' steady runs (SPLIT_STEADY): the dQ kernel's key tiles that every row of
a whole query tile sees whole (tiles.splits_steady), go through a loop with no causal or
bounds mask; the dK/dV kernel's query tiles whose rows all exist and see every key of its tile
(tiles.splits_steady: the light and table kinds at head dim 64 on sm_90) skip its mask by a
branch. Under the interpreter, from the user's
side: every layout a user brings (causal and bidirectional, a continuation after cached keys,
per-row offsets with left padding, a key mask, packed documents, position tensors, a sliding
window) gives the same bits with a split as without it, for the output and every gradient; each
launch takes the flag its GPU family's table gives; and the steady runs' bounds
(helpers._steady_keys, _steady_query_tiles) hold only tiles every row sees whole, as many as
there are."""
from __future__ import annotations

import importlib
import itertools

import pytest
import torch
import triton
import triton.language as tl

import bamgen
from bamgen.runtime.triton.helpers import _steady_keys, _steady_query_tiles
from bamgen.runtime.triton.launch import pinned
from bamgen.runtime.triton.tiles import DKDV_STEADY_AT, DQ_STEADY_AT, splits_steady
from tests.compiler.test_strategies import WINDOW   # (ALiBi inside |d| <= 5)
from tests.helpers import gqa_call_grads, write_prior

MODULES = {name: importlib.import_module(f"generated.{name}")
           for name in ("uniform", "laplace", "generalized_gaussian", "bam_ssmax", "forget_gate", "t5")}
# 70 rows: with the interpreter's dQ tile (32 rows, 16 keys) the middle query tile is whole and
# past two whole key tiles (the steady run runs), the last one ragged (it does not); with its
# dK/dV tile (16 rows, 32 keys) the first key tile has two steady query tiles
N = 70


def _call(module, layout, n=N, seed=11):
    """One call in a layout: its output and every gradient (q, k, v, the learnable parameters)."""
    g = torch.Generator().manual_seed(seed)
    nq, nk, batch, kw = n, n, 2, dict(causal=True)
    if layout == "bidirectional":
        kw = dict(causal=False)
    elif layout == "continuation":   # 40 new queries after 30 cached keys
        nq, kw = 40, dict(causal=True, q_offset=30)
    elif layout == "key_mask":   # a left-padded row beside a full one
        mask = torch.ones(2, nk, dtype=torch.bool)
        mask[0, :5] = False
        kw = dict(causal=True, key_mask=mask)
    elif layout == "row_offsets":   # batched generation: each row its own offsets, left padding
        mask = torch.ones(2, nk, dtype=torch.bool)
        mask[1, :7] = False
        nq, kw = 40, dict(causal=True, q_offset=torch.tensor([30, 0]), k_offset=torch.tensor([0, 5]),
                          key_mask=mask)
    elif layout == "packed":
        cu = torch.tensor([0, 3, 67, 70], dtype=torch.int32)   # (the second: 64 rows)
        batch, kw = 1, dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    elif layout == "positions":   # a gated model's positions: the cumulative log of its gates
        gates = torch.nn.functional.logsigmoid(torch.randn(1, 2, nk, generator=g) + 3)
        pos = gates.cumsum(-1)
        batch, kw = 1, dict(causal=True, pos_q=pos, pos_k=pos)
    return gqa_call_grads(module, g, batch, nq, nk, **kw)


def _split_and_whole(module, layout, kernel="dq", **kw):
    """The call with the kernel's split ("dq" or "dkdv") pinned on, then off."""
    with pinned(**{f"{kernel}_split": True}):
        split = _call(module, layout, **kw)
    with pinned(**{f"{kernel}_split": False}):
        whole = _call(module, layout, **kw)
    return split, whole


LAYOUTS = ["causal", "bidirectional", "continuation", "key_mask", "row_offsets", "packed"]


@pytest.mark.parametrize("kernel", ["dq", "dkdv"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ["uniform", "laplace", "generalized_gaussian", "bam_ssmax"])
def test_the_steady_run_gives_the_bits_of_one_masked_loop(name, layout, kernel):
    """With the split and without it, the same output and gradients, bit for bit: the steady
    run leaves out only where()s that select every score it sees (NoPE; a ramp, ALiBi; a table
    prior with three learnable parameters, GGD; a score other than s + log_prior, SSMax)."""
    split, whole = _split_and_whole(MODULES[name], layout, kernel)
    for got, want in zip(split, whole, strict=True):
        assert torch.equal(got, want), layout


@pytest.mark.parametrize("kernel", ["dq", "dkdv"])
@pytest.mark.parametrize("name, layout", [("forget_gate", "positions"), ("t5", "causal"),
                                          ("t5", "bidirectional")])
def test_kinds_a_gpu_does_not_split_give_the_same_bits_split(name, layout, kernel):
    """FoX's positions as tensors (its gates' cumulative log) and T5's per-distance sums: no GPU
    family splits their dQ loop (tiles.DQ_STEADY_AT), nor does the interpreter by default; split
    by a pin, the steady run computes what one masked loop does, the positions' gradients and
    the per-distance sums included."""
    split, whole = _split_and_whole(MODULES[name], layout, kernel)
    for got, want in zip(split, whole, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kernel", ["dq", "dkdv"])
@pytest.mark.parametrize("causal", [True, False])
def test_a_sliding_window_gives_the_same_bits_split(tmp_path, causal, kernel):
    """A window prior skips whole key tiles (SKIP): the dQ kernel's steady run starts at the
    window's first tile and may end one tile past its last key (those scores the prior hides,
    exactly); the dK/dV kernel's walks the window's query tiles alone."""
    module = bamgen.load(write_prior(tmp_path, WINDOW), cache_dir=tmp_path / "cache")
    assert module.TRAITS.skip == float("-inf")
    runs = []
    for split in (True, False):
        g = torch.Generator().manual_seed(4)
        with pinned(**{f"{kernel}_split": split}):
            runs.append(gqa_call_grads(module, g, 1, 32, 101, causal=causal, q_offset=64))
    for got, want in zip(*runs, strict=True):
        assert torch.equal(got, want)


class _Spy:
    """The prior's dQ kernel, recording the SPLIT_STEADY of each launch."""

    def __init__(self, kernel, seen):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.seen.append(kwargs["SPLIT_STEADY"])
            return self.kernel[grid](*args, **kwargs)
        return run


def _spy_dq(module, monkeypatch, kernel="bwd_dq"):
    seen = []
    kernels = module._prior.kernels().kernels
    monkeypatch.setitem(kernels, kernel, _Spy(kernels[kernel], seen))
    return seen


@pytest.mark.parametrize("family", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", ["uniform", "generalized_gaussian", "bam_ssmax"])
def test_each_launch_takes_its_family_s_flag(name, family, monkeypatch):
    """Under a GPU family's tiles (BAMGEN_INTERPRET_TILES) the dQ launch takes the split where
    DQ_STEADY_AT names its tile kind, family and head dim (the light kind on both families,
    the table and general kinds at head dim 64 on sm_90 alone), and computes the bits of one
    masked loop either way. 160 rows: the family's 64-row dQ tile has a whole query tile past
    whole key tiles (BAM-SSMax's on sm_90 reduces its sums per key tile, TILE_GRAD_SUMS)."""
    module = MODULES[name]
    monkeypatch.setenv("BAMGEN_INTERPRET_TILES", family)
    seen = _spy_dq(module, monkeypatch)
    got = _call(module, "causal", n=160)
    want_flag = splits_steady("bwd_dq", module._prior.traits.tile_kind, family, 16)
    assert want_flag == ((module._prior.traits.tile_kind, family, 64) in DQ_STEADY_AT)
    assert seen and all(flag == want_flag for flag in seen), (seen, want_flag)
    with pinned(dq_split=not want_flag):
        other = _call(module, "causal", n=160)
    for g, w in zip(got, other, strict=True):
        assert torch.equal(g, w)


def test_the_interpreter_splits_the_kinds_some_gpu_splits(monkeypatch):
    """The interpreter's default follows the kinds: those DQ_STEADY_AT names split (so the
    suite runs both loops), the others run one masked loop as every GPU does."""
    monkeypatch.delenv("BAMGEN_INTERPRET_TILES", raising=False)
    for name, split in (("uniform", True), ("generalized_gaussian", True), ("t5", False)):
        seen = _spy_dq(MODULES[name], monkeypatch)
        _call(MODULES[name], "causal", n=20)
        assert seen == [split], name
    kinds = {kind for kind, _, _ in DQ_STEADY_AT}
    assert kinds == {"light", "table", "general"}
    assert DKDV_STEADY_AT == {("light", "sm_90", 64), ("table", "sm_90", 64)}
    for name, split in (("uniform", True), ("generalized_gaussian", True), ("bam_ssmax", False)):
        seen = _spy_dq(MODULES[name], monkeypatch, "bwd_dkdv")
        _call(MODULES[name], "causal", n=20)
        assert seen == [split], name
    positional = MODULES["forget_gate"]._prior.positional.traits.tile_kind
    assert positional.startswith("positions") and not splits_steady("bwd_dq", positional, None, 64)
    assert not any(splits_steady("bwd_dq", positional, arch, d) for arch in ("sm_80", "sm_90")
                   for d in (64, 128))


# --------------------------------------------------------------------------------------------
# the steady run's bounds, against the keys each row sees


@triton.jit
def _steady_keys_probe(Out, first_row, Nq, Nk, q_offset, k_offset, n_lo, n_hi,
                       CAUSAL: tl.constexpr, SKIP: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, WHOLE_ROWS: tl.constexpr):
    tl.store(Out, _steady_keys(first_row, Nq, Nk, q_offset, k_offset, n_lo, n_hi, CAUSAL, SKIP,
                               BLOCK_M, BLOCK_N, WHOLE_ROWS))


def _sees_whole(tile, rows, Nk, q_offset, k_offset, causal, block_n):
    """Whether every row sees every key of the tile starting at key `tile`."""
    return all(j < Nk and (not causal or j + k_offset <= r + q_offset)
               for r in rows for j in range(tile, tile + block_n))


CASES = list(itertools.product([0, 32, 64], [40, 70, 96], [1, 17, 64, 70, 101],
                               [(0, 0), (30, 0), (0, 5), (-20, 0), (0, 40)], [True, False],
                               [True, False], [None, (5, 5), (-3, 40)]))


@pytest.mark.parametrize("block_m, block_n", [(32, 16), (64, 32)])
def test_the_steady_keys_are_the_tiles_every_row_sees_whole(block_m, block_n):
    """For query tiles at the start, middle and ragged end, key counts of 1 to past a tile,
    offsets either way (a continuation, a key offset, negative ones), causal or not, whole rows
    asked or not, with and without a window of distances [lo, hi]: the steady run [n_lo,
    n_full) starts where the loop does, runs whole tiles every row of the tile sees whole (and,
    with WHOLE_ROWS, exist), and without a window holds every such tile there is; the masked
    run [n_full, n_hi) takes the rest."""
    out = torch.zeros(1, dtype=torch.int32)
    for first_row, Nq, Nk, (q_off, k_off), causal, whole, window in CASES:
        n_hi = min(Nk, max(first_row + block_m + q_off - k_off, 0)) if causal else Nk
        n_lo = 0
        if window is not None:   # as _window_keys gives them
            lo, hi = window
            row0 = first_row + q_off - k_off
            n_lo = min(max(row0 - hi, 0), n_hi) // block_n * block_n
            n_hi = min(n_hi, max(row0 + block_m - lo, 0))
        _steady_keys_probe[(1,)](out, first_row, Nq, Nk, q_off, k_off, n_lo, n_hi, causal,
                                 window is not None, block_m, block_n, whole)
        n_full = int(out.item())
        case = (first_row, Nq, Nk, q_off, k_off, causal, whole, window, n_lo, n_hi, n_full)
        rows = range(first_row, first_row + block_m)
        assert n_lo <= n_full and (n_full - n_lo) % block_n == 0, case
        assert n_full <= triton.cdiv(max(n_hi, n_lo), block_n) * block_n, case
        if whole and first_row + block_m > Nq:
            assert n_full == n_lo, case
            continue
        for tile in range(n_lo, n_full, block_n):
            assert _sees_whole(tile, rows, Nk, q_off, k_off, causal, block_n), (case, tile)
        if window is None:   # as many as there are
            assert not _sees_whole(n_full, rows, Nk, q_off, k_off, causal, block_n), case


@triton.jit
def _steady_query_tiles_probe(Out, first_key, Nq, Nk, q_offset, k_offset, m_start, m_end,
                              CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    lo, hi = _steady_query_tiles(first_key, Nq, Nk, q_offset, k_offset, m_start, m_end, CAUSAL,
                                 BLOCK_M, BLOCK_N)
    tl.store(Out, lo)
    tl.store(Out + 1, hi)


QUERY_CASES = list(itertools.product([0, 32, 64], [1, 17, 40, 70, 96], [17, 64, 70, 96],
                                     [(0, 0), (30, 0), (0, 5), (-20, 0), (0, 40)], [True, False],
                                     [None, (5, 5), (-3, 40)]))


@pytest.mark.parametrize("block_m, block_n", [(16, 32), (32, 64)])
def test_the_steady_query_tiles_are_those_that_see_the_key_tile_whole(block_m, block_n):
    """For key tiles at the start, middle and ragged end, offsets either way, causal or not,
    with and without a window: of the query tiles the dK/dV kernel walks, [m_mid_lo, m_mid_hi)
    exist whole and see every key of the tile, the tiles before it (the diagonal) and after it
    (the ragged end) do not, and the three runs walk the tiles one loop would."""
    out = torch.zeros(2, dtype=torch.int32)
    for first_key, Nq, Nk, (q_off, k_off), causal, window in QUERY_CASES:
        m_start = max(first_key + k_off - q_off, 0) // block_m * block_m if causal else 0
        m_end = Nq
        if window is not None:   # as the kernel narrows them
            lo, hi = window
            col0 = first_key + k_off - q_off
            m_end = min(Nq, max(col0 + block_n + hi, 0))
            m_start = max(m_start, min(max(col0 + lo, 0), m_end) // block_m * block_m)
        _steady_query_tiles_probe[(1,)](out, first_key, Nq, Nk, q_off, k_off, m_start, m_end,
                                        causal, block_m, block_n)
        lo, hi = (int(x) for x in out)
        case = (first_key, Nq, Nk, q_off, k_off, causal, window, m_start, m_end, lo, hi)
        walked = list(range(m_start, m_end, block_m))
        runs = [*range(m_start, lo, block_m), *range(lo, hi, block_m), *range(hi, m_end, block_m)]
        assert runs == walked, case

        def steady(tile):
            keys = range(first_key, first_key + block_n)
            return tile + block_m <= Nq and all(
                j < Nk and (not causal or j + k_off <= r + q_off)
                for r in range(tile, tile + block_m) for j in keys)
        assert all(steady(t) for t in range(lo, hi, block_m)), case
        assert not any(steady(t) for t in range(m_start, lo, block_m)), case
        assert not any(steady(t) for t in range(hi, m_end, block_m)), case


@pytest.mark.parametrize("family", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", ["uniform", "laplace", "generalized_gaussian", "bam_ssmax"])
def test_each_dkdv_launch_takes_its_family_s_flag(name, family, monkeypatch):
    """Under a GPU family's tiles the dK/dV launch skips the mask on its steady query tiles
    where DKDV_STEADY_AT names its kind, family and head dim (the light and table kinds at 64 on
    sm_90: NoPE, ALiBi, GGD; their tile there takes one stage; not BAM-SSMax, general), and
    computes the bits of the masked loop
    either way. 160 rows: the family's 32-row query tiles past the 64-key diagonal are steady,
    the last one ragged."""
    module = MODULES[name]
    monkeypatch.setenv("BAMGEN_INTERPRET_TILES", family)
    seen = _spy_dq(module, monkeypatch, "bwd_dkdv")
    got = _call(module, "causal", n=160)
    want_flag = splits_steady("bwd_dkdv", module._prior.traits.tile_kind, family, 16)
    assert want_flag == ((module._prior.traits.tile_kind, family, 64) in DKDV_STEADY_AT)
    assert want_flag == (family == "sm_90" and name != "bam_ssmax")
    assert seen and all(flag == want_flag for flag in seen), (seen, want_flag)
    with pinned(dkdv_split=not want_flag):
        other = _call(module, "causal", n=160)
    for g, w in zip(got, other, strict=True):
        assert torch.equal(g, w)
