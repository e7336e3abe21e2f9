"""Packed documents, padding and per-row positions (docs/masks.md): key_mask, per-row offsets and
cu_seqlens on both paths (Triton under the interpreter), forward and every gradient.

* against the float64 reference (tests/reference.py, which applies the masks plainly);
* packed documents equal each document alone, for the output and every gradient;
* a left-padded row (key_mask plus offsets -pad) equals the same sequence unpadded;
* n (SSMax) counts the keys a query really sees;
* padding keys get zero dK and dV;
* malformed arguments raise ValueError naming them.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from bamgen.runtime.tables import row_key_counts
from tests.reference import reference_attention
from tests.runtime.test_runtime_fuzz import PRIORS
from tests.tolerance import assert_all_close

MASK_PRIORS = ["generalized_gaussian", "laplace", "bam_ssmax", "uniform"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PROFILE = os.environ.get("BAMGEN_HYPOTHESIS_PROFILE", "bamgen-ci")
SCALE = 10 if PROFILE == "bamgen-long" else 1
_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
NO_SHRINK = [p for p in Phase if p != Phase.shrink]


def load(prior):
    return importlib.import_module(f"generated.{prior}")


def params_for(mod, Hq, g):
    """Per-head values near the initial ones, learnable ones requiring grad."""
    out = {}
    for name, t in mod.default_params(Hq).items():
        jitter = 1 + 0.3 * torch.rand(Hq, generator=g)
        value = t * jitter if mod.PRIOR["params"][name]["domain"] != "real" else t + jitter - 1
        out[name] = value.detach().requires_grad_(name in mod.LEARNABLE)
    return out


def run(mod, q, k, v, dout, params, backend, **kw):
    """out and the gradients (q, k, v, then the learnable parameters) of one call."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    ps = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in params.items()}
    out = mod.attention(*leaves, **ps, backend=backend, **kw)
    learn = [ps[n] for n in mod.LEARNABLE]
    grads = torch.autograd.grad(out, leaves + learn, dout, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves + learn)]
    return out.detach(), grads


def check_against_reference(mod, prior, q, k, v, dout, params, backend, dtype, ctx, **kw):
    out, grads = run(mod, q, k, v, dout, params, backend, **kw)
    pdef = PRIORS[prior]
    ref_params = {n: t.detach() for n, t in params.items()}
    rkw = dict(kw, score=pdef.score, kink=pdef.kink, dout=dout)
    ref = reference_attention(q, k, v, ref_params, pdef.log_prior, **rkw)
    pt = reference_attention(q, k, v, ref_params, pdef.log_prior, compute_dtype=dtype, **rkw)
    results = [("out", out, ref.out, pt.out, ref.gross["out"]), ("dq", grads[0], ref.dq, pt.dq, ref.gross["dq"]),
               ("dk", grads[1], ref.dk, pt.dk, ref.gross["dk"]), ("dv", grads[2], ref.dv, pt.dv, ref.gross["dv"])]
    for name, g in zip(mod.LEARNABLE, grads[3:]):
        results.append(("d" + name, g, ref.dparams[name], pt.dparams[name], ref.gross["d" + name]))
    for name, got, *_ in results:
        assert bool(torch.isfinite(got).all()), f"{name} is not finite; {ctx}"
    assert_all_close(results, dtype, context=ctx)
    empty = ref.empty_rows
    if bool(empty.any()):
        assert bool((out.transpose(1, 2)[empty] == 0).all()), f"rows that see no key are not 0; {ctx}"
    return out, grads, ref


# --------------------------------------------------------------------------------------------
# random layouts against the reference


@dataclass
class MaskCase:
    prior: str
    backend: str
    dtype: str
    B: int
    Hq: int
    Hk: int
    Nq: int
    Nk: int
    D: int
    causal: bool
    q_offset: object      # int or list [B]
    k_offset: object
    key_mask: object      # None or list of lists [B][Nk] of 0/1
    seed: int


@st.composite
def mask_cases(draw, backend):
    B = draw(st.sampled_from([1, 2, 3]))
    Hq = draw(st.sampled_from([1, 2, 4]))
    Hk = draw(st.sampled_from([h for h in (1, 2) if Hq % h == 0]))
    Nq = draw(st.sampled_from([1, 2, 17, 33]))
    Nk = draw(st.sampled_from([1, 3, 17, 40]))
    per_row = draw(st.booleans())
    if per_row:
        q_offset = [draw(st.integers(-20, 40)) for _ in range(B)]
        k_offset = [draw(st.integers(-20, 40)) for _ in range(B)]
    else:
        q_offset, k_offset = draw(st.sampled_from([(0, 0), (max(Nk - Nq, 0), 0), (5, 3)]))
    key_mask = None
    if draw(st.booleans()):
        kind = draw(st.sampled_from(["left", "right", "random"]))
        key_mask = []
        for _ in range(B):
            pad = draw(st.integers(0, Nk))
            if kind == "left":
                row = [0] * pad + [1] * (Nk - pad)
            elif kind == "right":
                row = [1] * (Nk - pad) + [0] * pad
            else:
                row = [draw(st.integers(0, 1)) for _ in range(Nk)]
            key_mask.append(row)
    return MaskCase(draw(st.sampled_from(MASK_PRIORS)), backend, draw(st.sampled_from(list(DTYPES))), B, Hq, Hk,
                    Nq, Nk, draw(st.sampled_from([8, 16, 80])), draw(st.booleans()), q_offset, k_offset, key_mask,
                    draw(st.integers(0, 2 ** 31 - 1)))


def run_mask_case(case: MaskCase):
    mod = load(case.prior)
    dtype = DTYPES[case.dtype]
    g = torch.Generator().manual_seed(case.seed)

    def draw(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q, k, v = draw(case.B, case.Hq, case.Nq, case.D), draw(case.B, case.Hk, case.Nk, case.D), \
        draw(case.B, case.Hk, case.Nk, case.D)
    dout = draw(case.B, case.Hq, case.Nq, case.D)
    params = params_for(mod, case.Hq, g)
    kw = dict(causal=case.causal)
    kw["q_offset"] = torch.tensor(case.q_offset) if isinstance(case.q_offset, list) else case.q_offset
    kw["k_offset"] = torch.tensor(case.k_offset) if isinstance(case.k_offset, list) else case.k_offset
    if case.key_mask is not None:
        kw["key_mask"] = torch.tensor(case.key_mask, dtype=torch.bool)
    out, grads, _ = check_against_reference(mod, case.prior, q, k, v, dout, params, case.backend, dtype,
                                            repr(case), **kw)
    if case.key_mask is not None:   # padding keys get exactly zero dK and dV
        pad = ~kw["key_mask"]
        assert bool((grads[1].transpose(1, 2)[pad] == 0).all()), f"dk of padding keys; {case!r}"
        assert bool((grads[2].transpose(1, 2)[pad] == 0).all()), f"dv of padding keys; {case!r}"


@settings(max_examples=40 * SCALE, **_COMMON)
@given(data=st.data())
def test_masks_torch_match_reference(data):
    run_mask_case(data.draw(mask_cases("torch"), label="case"))


@settings(max_examples=10 * SCALE, phases=NO_SHRINK if SCALE == 1 else list(Phase), **_COMMON)
@given(data=st.data())
def test_masks_triton_match_reference(data):
    run_mask_case(data.draw(mask_cases("triton"), label="case"))


# --------------------------------------------------------------------------------------------
# packed documents


@st.composite
def packed_cases(draw, backend):
    docs = draw(st.integers(1, 5))
    q_lens = [draw(st.sampled_from([0, 1, 2, 7, 17, 30])) for _ in range(docs)]
    same = draw(st.booleans())
    k_lens = q_lens if same else [draw(st.sampled_from([0, 1, 3, 17, 25])) for _ in range(docs)]
    Hq = draw(st.sampled_from([1, 2, 4]))
    Hk = draw(st.sampled_from([h for h in (1, 2) if Hq % h == 0]))
    return dict(prior=draw(st.sampled_from(MASK_PRIORS)), backend=backend, q_lens=q_lens, k_lens=k_lens,
                Hq=Hq, Hk=Hk, D=draw(st.sampled_from([8, 16])), causal=draw(st.booleans()),
                masked=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 31 - 1)))


def run_packed_case(c):
    """The packed call equals each document alone (output and every gradient) and the reference."""
    mod = load(c["prior"])
    g = torch.Generator().manual_seed(c["seed"])
    tq, tk = sum(c["q_lens"]), sum(c["k_lens"])
    q, k, v = (torch.randn(1, h, n, c["D"], generator=g) for h, n in ((c["Hq"], tq), (c["Hk"], tk), (c["Hk"], tk)))
    dout = torch.randn(1, c["Hq"], tq, c["D"], generator=g)
    params = params_for(mod, c["Hq"], g)
    cu_q = torch.tensor([0] + list(torch.tensor(c["q_lens"]).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(c["k_lens"]).cumsum(0)), dtype=torch.int32)
    key_mask = (torch.rand(1, tk, generator=g) > 0.3) if c["masked"] else None
    kw = dict(causal=c["causal"], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, key_mask=key_mask)
    out, grads, _ = check_against_reference(mod, c["prior"], q, k, v, dout, params, c["backend"],
                                            torch.float32, repr(c), **kw)
    dparams = [torch.zeros(c["Hq"]) for _ in mod.LEARNABLE]
    for d in range(len(c["q_lens"])):
        qs, qe, ks, ke = int(cu_q[d]), int(cu_q[d + 1]), int(cu_k[d]), int(cu_k[d + 1])
        if qe == qs:
            continue
        alone = dict(causal=c["causal"], key_mask=None if key_mask is None else key_mask[:, ks:ke])
        o, gr = run(mod, q[:, :, qs:qe], k[:, :, ks:ke], v[:, :, ks:ke], dout[:, :, qs:qe], params, c["backend"],
                    **alone)
        torch.testing.assert_close(out[:, :, qs:qe], o, rtol=1e-5, atol=1e-5, msg=lambda m: f"doc {d}: {m}")
        torch.testing.assert_close(grads[0][:, :, qs:qe], gr[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads[1][:, :, ks:ke], gr[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads[2][:, :, ks:ke], gr[2], rtol=1e-5, atol=1e-5)
        for acc, gp in zip(dparams, gr[3:]):
            acc += gp
    for name, got, want in zip(mod.LEARNABLE, grads[3:], dparams):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"d{name}: {m}")


@settings(max_examples=25 * SCALE, **_COMMON)
@given(data=st.data())
def test_packed_documents_torch(data):
    run_packed_case(data.draw(packed_cases("torch"), label="case"))


@settings(max_examples=6 * SCALE, phases=NO_SHRINK if SCALE == 1 else list(Phase), **_COMMON)
@given(data=st.data())
def test_packed_documents_triton(data):
    run_packed_case(data.draw(packed_cases("triton"), label="case"))


# --------------------------------------------------------------------------------------------
# left padding


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("prior", ["generalized_gaussian", "bam_ssmax"])
def test_left_padded_rows_equal_the_unpadded_sequence(prior, backend):
    """Generation's batch: row b is pad_b padding keys then its sequence; with key_mask and
    q_offset = k_offset = -pad_b every row's positions start at 0 at its first real token, so a
    padded row gives what its sequence alone gives (queries on the padding see nothing)."""
    mod = load(prior)
    g = torch.Generator().manual_seed(5)
    N, Hq, D, pads = 12, 2, 16, [0, 3, 7]
    params = params_for(mod, Hq, g)
    seqs = [torch.randn(3, 1, Hq, N - p, D, generator=g) for p in pads]     # q, k, v of each row
    q = torch.zeros(len(pads), Hq, N, D)
    k, v = torch.zeros_like(q), torch.zeros_like(q)
    for b, (p, s) in enumerate(zip(pads, seqs)):
        q[b, :, p:], k[b, :, p:], v[b, :, p:] = s[0, 0], s[1, 0], s[2, 0]
    key_mask = torch.arange(N)[None, :] >= torch.tensor(pads)[:, None]
    offsets = -torch.tensor(pads)
    dout = torch.randn(len(pads), Hq, N, D, generator=g)
    out, grads = run(mod, q, k, v, dout, params, backend, causal=True, key_mask=key_mask, q_offset=offsets,
                     k_offset=offsets)
    for b, (p, s) in enumerate(zip(pads, seqs)):
        o, gr = run(mod, s[0], s[1], s[2], dout[b:b + 1, :, p:], params, backend, causal=True)
        torch.testing.assert_close(out[b:b + 1, :, p:], o, rtol=1e-5, atol=1e-5)
        assert bool((out[b, :, :p] == 0).all())          # queries on the padding see nothing
        torch.testing.assert_close(grads[0][b:b + 1, :, p:], gr[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads[1][b:b + 1, :, p:], gr[1], rtol=1e-5, atol=1e-5)
        assert bool((grads[1][b, :, :p] == 0).all()) and bool((grads[2][b, :, :p] == 0).all())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nan_in_padding_reaches_nothing(backend):
    """A padded batch whose padding slots hold NaN (uninitialised memory, a failed embedding):
    key_mask hides those keys, so every output and gradient equals the batch padded with zeros
    (a masked key is read as 0, never multiplied by a weight of 0)."""
    mod = load("generalized_gaussian")
    g = torch.Generator().manual_seed(11)
    B, Hq, N, D, pads = 3, 2, 12, 16, [0, 3, 7]
    params = params_for(mod, Hq, g)
    q, k, v, dout = (torch.randn(B, Hq, N, D, generator=g) for _ in range(4))
    key_mask = torch.arange(N)[None, :] >= torch.tensor(pads)[:, None]
    offsets = -torch.tensor(pads)
    kw = dict(causal=True, key_mask=key_mask, q_offset=offsets, k_offset=offsets)
    pad = ~key_mask[:, None, :, None]
    clean = run(mod, *(t.masked_fill(pad, 0.0) for t in (q, k, v)), dout, params, backend, **kw)
    dirty = run(mod, *(t.masked_fill(pad, float("nan")) for t in (q, k, v)), dout, params, backend, **kw)
    # (finite, and equal up to the rounding of a different summation order: the CPU path takes
    # its careful route for non-finite inputs)
    torch.testing.assert_close(dirty[0], clean[0], rtol=1e-6, atol=1e-6)
    for got, want in zip(dirty[1], clean[1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prior", ["generalized_gaussian", "bam_ssmax"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rows_that_see_no_key_stay_zero_beside_an_infinite_value(prior, backend):
    """Rows before the first key see nothing: their output and dQ are exactly 0, also when a
    key they do not see holds inf in V (the kernels' P @ V multiplies it by a P of 0, and
    0 * inf is NaN). Rows that do see that key are non-finite, as the input makes them."""
    mod = load(prior)
    g = torch.Generator().manual_seed(3)
    B, Hq, Nq, Nk, D, first_key = 1, 2, 17, 40, 16, 5
    params = params_for(mod, Hq, g)
    q, dout = (torch.randn(B, Hq, Nq, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, Hq, Nk, D, generator=g) for _ in range(2))
    v[:, :, 2] = float("inf")   # key position first_key + 2: rows 7.. see it
    out, grads = run(mod, q, k, v, dout, params, backend, causal=True, k_offset=first_key)
    dead = slice(0, first_key)
    assert bool((out[:, :, dead] == 0).all()), out[:, :, dead]
    assert bool((grads[0][:, :, dead] == 0).all()), grads[0][:, :, dead]
    assert not bool(torch.isfinite(out[:, :, first_key + 2:]).all())


@pytest.mark.parametrize("prior", ["uniform", "generalized_gaussian", "bam_ssmax", "laplace"])
def test_a_key_a_row_weighs_zero_gets_no_nan_in_dk_from_it(prior):
    """A score whose weight underflows to exactly 0 passes no gradient to its key's dk on the
    Triton path, NaN or not (the dK/dV kernel selects dS where P is not 0; docs/reliability.md,
    "Non-finite inputs"; a ramp, ALiBi, selects on the mask and keeps SDPA's 0 * NaN). The last
    key, seen by the last row alone (causal), has a score so far below that row's best that its
    weight is 0; the last row's incoming gradient holds a NaN, which reaches the dk of every key
    that row weighs, but not of the key it does not; that key's dv is P dO, NaN as SDPA's."""
    mod = load(prior)
    g = torch.Generator().manual_seed(5)
    B, Hq, N, D = 1, 2, 23, 16
    params = params_for(mod, Hq, g)
    q, k, v, dout = (torch.randn(B, Hq, N, D, generator=g) for _ in range(4))
    k[:, :, -1] = -1e4 * q[:, :, -1]   # a score ~1e4 * |q|^2 below the row's best: exp underflows
    dout[:, :, -1, 0] = float("nan")
    out, (dq, dk, dv, *_) = run(mod, q, k, v, dout, params, "triton", causal=True)
    assert bool(torch.isfinite(out).all())
    assert not bool(torch.isfinite(dk[:, :, :-1]).all())   # the keys the last row weighs: NaN
    assert bool(torch.isnan(dv[:, :, -1, 0]).all())         # P dO: 0 * NaN
    if prior == "laplace":
        assert not bool(torch.isfinite(dk[:, :, -1]).any()), dk[:, :, -1]
    else:
        assert bool((dk[:, :, -1] == 0).all()), dk[:, :, -1]


def test_n_counts_the_keys_a_query_sees():
    """SSMax's n after the causal rule, the document and key_mask, against a plain count: a
    query that sees 3 keys has logit (s + log_prior) * ssmax * log 3."""
    mod = load("bam_ssmax")
    key_mask = torch.tensor([[1, 0, 1, 1, 0, 1]], dtype=torch.bool)
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    counts = row_key_counts(mod._prior, 1, 6, 6, 0, 0, True, "cpu", key_mask=key_mask,
                            cu_seqlens_q=cu, cu_seqlens_k=cu)
    # doc 0 = keys 0..3 (mask 1 0 1 1), doc 1 = keys 4..5 (mask 0 1); causal within a document
    assert counts.tolist() == [[1, 1, 2, 3, 0, 1]]


# --------------------------------------------------------------------------------------------
# malformed arguments


@pytest.mark.parametrize("kwargs, match", [
    (dict(cu_seqlens_q=torch.tensor([1, 4, 6], dtype=torch.int32)), "cu_seqlens_q must start at 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 4, 3, 6], dtype=torch.int32),
          cu_seqlens_k=torch.tensor([0, 4, 3, 6], dtype=torch.int32)), "non-decreasing"),
    (dict(cu_seqlens_q=torch.tensor([0, 4, 5], dtype=torch.int32)), "must end at the packed length 6"),
    (dict(cu_seqlens_q=torch.tensor([0.0, 4.0, 6.0])), "cu_seqlens_q must be an int32 or int64 tensor"),
    (dict(cu_seqlens_q=torch.tensor([0, 6], dtype=torch.int32)), "same number of documents"),
    (dict(cu_seqlens_k=None), "go together"),
    (dict(q_offset=2), "must be 0 with packed documents"),
])
def test_malformed_packed_arguments(kwargs, match):
    mod = load("laplace")
    q = torch.randn(1, 2, 6, 8)
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    args = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, **kwargs}
    with pytest.raises(ValueError, match=match):
        mod.attention(q, q, q, b=2.0, backend="torch", **args)


@pytest.mark.parametrize("kwargs, match", [
    (dict(key_mask=torch.ones(2, 5, dtype=torch.bool)), r"key_mask must be a bool tensor of shape \[B, Nk\]"),
    (dict(key_mask=torch.ones(2, 6)), "key_mask must be a bool tensor"),
    (dict(q_offset=torch.tensor([0, 1, 2])), r"q_offset must be an int or an integer tensor of shape \[B\]"),
    (dict(k_offset=torch.tensor([0.5, 1.0])), "k_offset must be an int or an integer tensor"),
    (dict(q_offset=torch.tensor([0, 2 ** 25])), "q_offset"),
    (dict(cu_seqlens_q=torch.tensor([0, 6], dtype=torch.int32),
          cu_seqlens_k=torch.tensor([0, 6], dtype=torch.int32)), "take B = 1"),
])
def test_malformed_mask_arguments(kwargs, match):
    mod = load("laplace")
    q = torch.randn(2, 2, 6, 8)
    with pytest.raises(ValueError, match=match):
        mod.attention(q, q, q, b=2.0, backend="torch", **kwargs)


def test_packed_benchmark_smoke():
    """benchmarks/packed.py --quick runs and prints its table (docs/performance.md has the
    figures of the full run)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "packed.py"), "--quick"],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "| generalized_gaussian |" in res.stdout and "packed / one-causal" in res.stdout


# --------------------------------------------------------------------------------------------
# a GPU's tiles (BAMGEN_INTERPRET_TILES): the masked layouts halve them


@pytest.mark.parametrize("family", ["sm_90", "sm_80"])
@pytest.mark.parametrize("prior", ["uniform", "generalized_gaussian", "bam_ssmax"])
def test_masks_and_documents_with_a_gpu_family_s_tiles(prior, family, monkeypatch):
    """A key mask with per-row offsets, and packed documents with a mask, through the tiles a GPU
    of that family launches for a masked layout (launch.masked_tile: the forward's key tile
    halved, dQ over 8 warps; the table read of its head dims), run by the interpreter: against
    the reference, and each document alone."""
    from bamgen.runtime.triton import launch
    monkeypatch.setenv("BAMGEN_INTERPRET_TILES", family)
    tiles, real = [], launch.candidates
    monkeypatch.setattr(launch, "candidates", lambda prior, kernel, head_dim, arch, masked=False, tma=False:
                        tiles.append((kernel, arch, masked, real(prior, kernel, head_dim, arch, masked)[0],
                                      real(prior, kernel, head_dim, arch, False)[0]))
                        or real(prior, kernel, head_dim, arch, masked, tma))
    pad = [[0] * 6 + [1] * 34, [1] * 29 + [0] * 11]
    run_mask_case(MaskCase(prior, "triton", "fp32", 2, 4, 2, 33, 40, 16, True, [3, 0], [0, 5], pad, 7))
    run_packed_case(dict(prior=prior, backend="triton", q_lens=[7, 0, 30], k_lens=[7, 0, 30], Hq=2,
                         Hk=1, D=16, causal=True, masked=True, seed=5))
    assert tiles and all(arch == family and masked for _, arch, masked, _, _ in tiles)
    launched = {kernel: (tile, plain) for kernel, _, _, tile, plain in tiles}
    fwd, plain = launched["fwd"]   # half the key tile (launch.masked_tile), 128 queries or 64
    assert fwd[0] == plain[0] >= 64 and fwd[1] < plain[1], launched
    dq, plain = launched["bwd_dq"]   # the same tile over 8 warps
    assert dq[:2] == plain[:2] and dq[2] == 8 > plain[2], launched
