"""The forward's keys and values through TMA (KV_TMA of the forward kernel: host tensor
descriptors over K and V, launch.kv_tma and kv_descriptors; tiles.FWD_TMA_AT). Under the
interpreter, from the user's side: the inputs a user brings (GQA, ragged lengths, a head dim
that is padded, a continuation after cached keys, bidirectional, fp16 and bf16) give the same
bits read through descriptors as through pointers, for the output and every gradient; a GPU
family's choice is what the launch takes (pointers everywhere since an H200 timed both reads:
tiles.KV_TMA_SHIPPED; pinned to TMA, NoPE's 4-warp tile on sm_90 at head dim 64 and every
kind's decode kernel read through descriptors), and what a descriptor cannot read, or a layout
that must not, keeps pointers.
And NoPE's P in one FFMA (helpers.py, "P of a scaled score"): a logit past float32's range still
makes its row NaN."""
from __future__ import annotations

import importlib

import pytest
import torch

from bamgen.runtime.triton import launch, tiles
from bamgen.runtime.triton.launch import pinned
from bamgen.runtime.triton.tiles import FWD_TMA_AT

MODULES = {name: importlib.import_module(f"generated.{name}")
           for name in ("uniform", "laplace", "generalized_gaussian", "bam_ssmax")}
FIRE = importlib.import_module("generated.fire")


def _call(module, dtype, batch, hq, hk, nq, nk, d, seed=0, **kw):
    """One Triton-path call with the module's default parameters: output and every gradient."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, nq, d, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(batch, hk, nk, d, generator=g).to(dtype).requires_grad_() for _ in range(2))
    params = {n: t.clone().requires_grad_() for n, t in module.default_params(hq).items()}
    out = module.attention(q, k, v, backend="triton", **kw, **params)
    grads = torch.autograd.grad(out, [q, k, v, *params.values()],
                                torch.randn(out.shape, generator=g).to(dtype), allow_unused=True)
    return [out.detach(), *(t for t in grads if t is not None)]


@pytest.fixture
def descriptors(monkeypatch):
    """The (block_n, head_dim) of each kv_descriptors call, and the forward's launch configs."""
    seen = {"descriptors": [], "configs": []}
    real_descriptors, real_launch = launch.kv_descriptors, launch.launch

    def spy_descriptors(k, v, block_n, head_dim):
        seen["descriptors"].append((block_n, head_dim))
        return real_descriptors(k, v, block_n, head_dim)

    def spy_launch(prior, kernel, head_dim, device, key, run, *args):
        if kernel != "fwd":
            return real_launch(prior, kernel, head_dim, device, key, run, *args)
        return real_launch(prior, kernel, head_dim, device, key,
                           lambda config: seen["configs"].append(config) or run(config), *args)

    monkeypatch.setattr(launch, "kv_descriptors", spy_descriptors)
    monkeypatch.setattr(launch, "launch", spy_launch)
    return seen


CASES = {   # (batch, query heads, kv heads, Nq, Nk, head dim, call keywords)
    "gqa-ragged": (2, 4, 2, 17, 17, 64, dict(causal=True)),
    "one-token": (1, 2, 1, 1, 1, 64, dict(causal=True)),
    "long-ragged": (1, 2, 1, 123, 123, 64, dict(causal=True)),
    "padded-head-dim": (1, 2, 2, 37, 37, 40, dict(causal=True)),
    "bidirectional": (2, 2, 1, 29, 45, 32, dict(causal=False)),
    "continuation": (1, 2, 1, 33, 100, 64, dict(causal=True, q_offset=67)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(MODULES))
def test_descriptors_read_what_pointers_read(name, dtype, case, descriptors):
    """Pinned to TMA, the forward reads every key tile through descriptors (zeros past Nk and
    past the real head dim, where the pointer loads mask) and gives the pointer forward's bits;
    the backward, which reads P from the forward's statistics, gives its gradients."""
    batch, hq, hk, nq, nk, d, kw = CASES[case]
    with pinned(kv="pointers"):
        want = _call(MODULES[name], dtype, batch, hq, hk, nq, nk, d, **kw)
    assert descriptors["descriptors"] == []
    with pinned(kv="tma"):
        got = _call(MODULES[name], dtype, batch, hq, hk, nq, nk, d, **kw)
    padded = max(16, 1 << (d - 1).bit_length())
    assert descriptors["descriptors"] and {h for _, h in descriptors["descriptors"]} == {padded}
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_sm90_reads_nope_through_pointers_and_pinned_through_descriptors(descriptors, monkeypatch):
    """With sm_90's tiles (BAMGEN_INTERPRET_TILES), NoPE's forward at head dim 64 reads K and
    V through pointers over the tile table's 8-warp tile, the kernel an H200 timed at 0.93x the
    TMA one (tiles.KV_TMA_SHIPPED); pinned to TMA it takes FWD_TMA_AT's 4-warp tile through
    descriptors of its key tile (the variant `make gpu-check` times against it) and gives the
    same bits (the interpreter runs no warps: what it checks is the 128x64 blocks and the
    reads)."""
    monkeypatch.setenv("BAMGEN_INTERPRET_TILES", "sm_90")
    want = _call(MODULES["uniform"], torch.bfloat16, 1, 2, 1, 150, 150, 64, causal=True)
    assert descriptors["configs"] == [(128, 64, 8, 3)] and descriptors["descriptors"] == []
    tile = FWD_TMA_AT[("light", "sm_90", 64)]
    with pinned(kv="tma"):
        got = _call(MODULES["uniform"], torch.bfloat16, 1, 2, 1, 150, 150, 64, causal=True)
    assert descriptors["configs"][1:] == [tile]
    assert descriptors["descriptors"] == [(tile[1], 64)]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


DECODE_CASES = {   # (batch, query heads, kv heads, Nq, Nk, head dim, call keywords)
    "one-row-over-splits": (2, 4, 2, 1, 300, 64, dict(causal=True, q_offset=299)),
    "speculative-rows": (1, 2, 1, 5, 77, 40, dict(causal=True, q_offset=72)),
    "bidirectional": (1, 2, 2, 16, 16, 64, dict(causal=False)),
}


@pytest.mark.parametrize("case", sorted(DECODE_CASES))
@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_decode_step_reads_through_descriptors_what_pointers_read(name, case, descriptors):
    """A generation step (at most 16 rows, no backward: the split-KV decode kernel) pinned to
    TMA reads its splits' key tiles through descriptors and gives the pointer kernel's bits:
    one row against 300 cached keys (several splits, a ragged last tile), speculative rows with
    a padded head dim, a bidirectional block; GQA."""
    batch, hq, hk, nq, nk, d, kw = DECODE_CASES[case]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(batch, h, n, d, generator=g).to(torch.bfloat16)
               for h, n in ((hq, nq), (hk, nk), (hk, nk)))
    params = MODULES[name].default_params(hq)
    with torch.no_grad():
        with pinned(kv="pointers"):
            want = MODULES[name].attention(q, k, v, backend="triton", **kw, **params)
        assert descriptors["descriptors"] == []
        with pinned(kv="tma"):
            got = MODULES[name].attention(q, k, v, backend="triton", **kw, **params)
    assert descriptors["descriptors"] and descriptors["configs"] == []   # (no forward kernel)
    assert torch.equal(got, want)


def test_sm90_reads_every_kind_s_decode_through_pointers_and_pinned_through_descriptors(
        descriptors, monkeypatch):
    """With sm_90's tiles every kind's decode kernel reads K and V through pointers (an H200
    timed the call through descriptors at 1.03-1.07x: tiles.KV_TMA_SHIPPED); pinned to TMA,
    every kind's but heavy's reads them through descriptors of its 16x128 tile's keys at head
    dims 64 and 128, and a key mask keeps pointers."""
    monkeypatch.setenv("BAMGEN_INTERPRET_TILES", "sm_90")
    g = torch.Generator().manual_seed(4)
    for name, d in (("uniform", 64), ("generalized_gaussian", 128), ("bam_ssmax", 64)):
        q = torch.randn(1, 2, 1, d, generator=g).to(torch.bfloat16)
        k, v = (torch.randn(1, 1, 40, d, generator=g).to(torch.bfloat16) for _ in range(2))
        params = MODULES[name].default_params(2)
        with torch.no_grad():
            want = MODULES[name].attention(q, k, v, backend="triton", q_offset=39, **params)
            assert descriptors["descriptors"] == []
            with pinned(kv="tma"):
                got = MODULES[name].attention(q, k, v, backend="triton", q_offset=39, **params)
                assert descriptors["descriptors"] == [(128, d)]
                MODULES[name].attention(q, k, v, backend="triton", q_offset=39,
                                        key_mask=torch.ones(1, 40, dtype=torch.bool), **params)
                assert len(descriptors["descriptors"]) == 1
        assert torch.equal(got, want)
        descriptors["descriptors"].clear()


def _tma_for(module, monkeypatch, family="sm_90", dtype=torch.bfloat16, d=64, traced=False,
             offset=0, kernel="fwd", **layout):
    """launch.kv_tma for a call of these inputs (what the forward launch decides)."""
    if family is None:
        monkeypatch.delenv("BAMGEN_INTERPRET_TILES", raising=False)
    else:
        monkeypatch.setenv("BAMGEN_INTERPRET_TILES", family)
    q = torch.zeros(1, 2, 20, d, dtype=dtype)
    k, v = (torch.zeros(1 * 2 * 20 * d + offset, dtype=dtype)[offset:].view(1, 2, 20, d)
            for _ in range(2))
    lay = launch.KernelLayout(q, layout.get("q_offset", 0), 0, layout.get("key_mask"),
                              layout.get("cu"), layout.get("cu"))
    module = FIRE if module == "fire" else MODULES[module]
    return launch.kv_tma(module._prior, q, k, v, lay, traced, kernel)


def test_no_kernel_reads_through_descriptors_unless_pinned(monkeypatch):
    """What ships since an H200 timed both reads (tiles.KV_TMA_SHIPPED): pointers for the
    forward and the decode kernel, on every family, kind and head dim."""
    assert tiles.KV_TMA_SHIPPED == frozenset()
    for kernel in ("fwd", "decode"):
        for name, d in (("uniform", 64), ("uniform", 128), ("generalized_gaussian", 64)):
            assert not _tma_for(name, monkeypatch, d=d, kernel=kernel), (kernel, name, d)


def test_where_the_forward_reads_through_descriptors(monkeypatch):
    """Where a kernel that tiles.KV_TMA_SHIPPED names reads through descriptors: where
    FWD_TMA_AT (DECODE_TMA_AT) names the family, kind and head dim, for inputs a descriptor
    reads (16-bit, rows 16-byte aligned) in a layout that may: a key mask (a padding key's v
    must read as 0), per-row offsets and packed documents keep pointers, and so do traced
    launches."""
    monkeypatch.setattr(tiles, "KV_TMA_SHIPPED", frozenset({"fwd", "decode"}))
    assert _tma_for("uniform", monkeypatch)
    assert _tma_for("laplace", monkeypatch, dtype=torch.float16)
    assert not _tma_for("uniform", monkeypatch, family=None)        # the interpreter's own tiles
    assert not _tma_for("uniform", monkeypatch, family="sm_80")
    assert not _tma_for("uniform", monkeypatch, d=128)
    assert not _tma_for("generalized_gaussian", monkeypatch)        # the table kind
    assert not _tma_for("uniform", monkeypatch, dtype=torch.float32)
    assert not _tma_for("uniform", monkeypatch, d=36)               # rows of 72 bytes
    assert not _tma_for("uniform", monkeypatch, offset=1)           # a base 2 bytes off
    assert not _tma_for("uniform", monkeypatch, traced=True)
    assert not _tma_for("uniform", monkeypatch, key_mask=torch.ones(1, 20, dtype=torch.bool))
    assert not _tma_for("uniform", monkeypatch, q_offset=torch.tensor([3]))
    assert not _tma_for("uniform", monkeypatch, cu=torch.tensor([0, 7, 20], dtype=torch.int32))
    # the decode kernel: every kind at head dims 64 and 128 on sm_90, the same layouts
    assert _tma_for("generalized_gaussian", monkeypatch, kernel="decode")
    assert _tma_for("bam_ssmax", monkeypatch, d=128, kernel="decode")
    assert not _tma_for("generalized_gaussian", monkeypatch, d=256, kernel="decode")
    assert not _tma_for("uniform", monkeypatch, family="sm_80", kernel="decode")
    assert not _tma_for("fire", monkeypatch, d=128, kernel="decode")   # (heavy: pointers)
    assert not _tma_for("uniform", monkeypatch, kernel="decode",
                        key_mask=torch.ones(1, 20, dtype=torch.bool))
    with pinned(kv="pointers"):
        assert not _tma_for("uniform", monkeypatch)
        assert not _tma_for("uniform", monkeypatch, kernel="decode")
    with pinned(kv="tma"):   # any family and kind, where the inputs and layout allow
        assert _tma_for("generalized_gaussian", monkeypatch, family=None)
        assert not _tma_for("uniform", monkeypatch, dtype=torch.float32)
        assert not _tma_for("uniform", monkeypatch, key_mask=torch.ones(1, 20, dtype=torch.bool))


def test_a_masked_or_packed_call_pinned_to_descriptors_keeps_pointers(descriptors):
    """pinned(kv="tma") asks where the layout allows: a key mask and packed documents run the
    pointer forward, and compute what it computes."""
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[0, :4] = False
    cu = torch.tensor([0, 11, 30], dtype=torch.int32)
    for kw, batch in ((dict(key_mask=mask), 2), (dict(cu_seqlens_q=cu, cu_seqlens_k=cu), 1)):
        with pinned(kv="tma"):
            got = _call(MODULES["uniform"], torch.bfloat16, batch, 2, 1, 30, 30, 64, **kw)
        want = _call(MODULES["uniform"], torch.bfloat16, batch, 2, 1, 30, 30, 64, **kw)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
    assert descriptors["descriptors"] == []


def test_a_bad_kv_pin_is_refused_by_name():
    with pytest.raises(ValueError, match=r"pinned\(kv=...\): 'tmx' is not one of pointers, tma"):
        with pinned(kv="tmx"):
            pass


def test_a_logit_past_float32_s_range_makes_its_row_nan():
    """q.k = 2**126 is a float32, its logit q.k * scale * log2(e) is not: NoPE's forward, whose
    P is one FFMA against the row's max (inf here), gives the row NaN as exp2(inf - inf) did,
    not a silent 0; the rows it does not reach stay finite. In the forward kernel with one key
    tile (4 rows with a backward to follow; with more tiles a later tile's rescaling by
    exp2(inf - inf) makes the NaN too) and with two (20 rows), and in a decode step (4 rows: the
    split-KV kernels, whose merge weighs the split by its max)."""
    for n, grad in ((4, True), (20, True), (4, False)):
        q = torch.zeros(1, 1, n, 16)
        k, v = torch.zeros(1, 1, n, 16), torch.randn(1, 1, n, 16)
        q[0, 0, 2, 0] = k[0, 0, 1, 0] = 2.0 ** 63
        out = MODULES["uniform"].attention(q.requires_grad_(grad), k, v, causal=True, scale=3.0,
                                           backend="triton").detach()
        assert out[0, 0, 2].isnan().all(), (n, grad)
        assert out[0, 0, [0, 1, 3]].isfinite().all(), (n, grad)
