"""Every shipped prior beyond the core three, against a float64 reference written here again in
plain torch (independent of the compiler), on both paths, output and every learnable gradient.
(uniform, laplace and generalized_gaussian are covered in depth by test_properties.py.)"""
import dataclasses
import importlib
import math
import os

import pytest
import torch

from bamgen.runtime.triton.tiles import INTERPRET_TILES
from tests.reference import reference_attention
from tests.tolerance import assert_all_close


def _bam(d, p):
    return -torch.exp(p["ta"]) * (torch.abs(-d - 2 * torch.sinh(p["tm"])) + 1e-5) ** p["tb"]


def _t5(bidirectional):
    from transformers.models.t5.modeling_t5 import T5Attention

    def log_prior(d, p):   # T5's own bucketing of j - i, then the head's bias of the bucket
        bucket = T5Attention._relative_position_bucket((-d).long(), bidirectional=bidirectional,
                                                       num_buckets=32, max_distance=128)
        w = p["w"]
        return w.gather(-1, bucket[..., None].expand(*w.shape[:-1], 1)).squeeze(-1)
    return log_prior


def _fire(d, p):
    """FIRE's bias materialised as its paper's code computes it: the MLP on every (i, j)."""
    x = torch.log(p["c"] * torch.abs(d) + 1) / torch.log(p["c"] * torch.maximum(p["i"], p["L"]) + 1)
    hidden = torch.relu(p["w1"] * x[..., None] + p["b1"])
    return (p["w2"] * hidden).sum(-1) + p["b2"]


def _sandwich(d, p):
    return p["a"] * sum(torch.cos(d / 10000 ** (2 * k / 128)) for k in range(1, 65))


def _pattern(rows, cols, scale=1.0, shift=0.0):
    """Deterministic, varied values (rows x cols) for the vector parameters."""
    return [[scale * math.sin(1.7 * r + 0.61 * c + shift) for c in range(cols)] for r in range(rows)]


LIBRARY = {
    # name: (log_prior, score, {param: per-head values}, learnable params, kink)
    "bam": (_bam, None,
            {"ta": [-1.0, -3.0, 0.5, -2.0], "tb": [1.0, -0.5, 0.3, 1.7], "tm": [0.0, 0.3, -1.2, 2.0]},
            ("ta", "tb"), None),
    "bam_ssmax": (_bam, lambda s, lp, n, p: (s + lp) * p["ssmax"] * torch.log(n.to(s.dtype)),
                  {"ta": [-1.0, -3.0, 0.5, -2.0], "tb": [1.0, -0.5, 0.3, 1.7],
                   "tm": [0.0, 0.3, -1.2, 2.0], "ssmax": [0.4, 0.2, 0.7, 1.1]},
                  ("ta", "tb", "ssmax"), None),
    "gaussian": (lambda d, p: -(d - p["mu"]) ** 2 / (2 * p["sigma"] ** 2), None,
                 {"sigma": [2.0, 5.0, 9.0, 30.0], "mu": [0.0, 1.5, 3.0, -2.0]}, ("sigma", "mu"), None),
    "cauchy": (lambda d, p: -torch.log1p(((d - p["mu"]) / p["gamma"]) ** 2), None,
               {"gamma": [1.0, 3.0, 8.0, 0.5], "mu": [0.0, 2.0, -1.0, 4.0]}, ("gamma", "mu"), None),
    "kerple_log": (lambda d, p: -p["r1"] * torch.log1p(p["r2"] * torch.abs(d)), None,
                   {"r1": [1.0, 0.5, 2.0, 0.1], "r2": [1.0, 0.2, 3.0, 0.05]}, ("r1", "r2"),
                   lambda d, p: d == 0),
    "kerple_power": (lambda d, p: -p["r1"] * torch.abs(d) ** p["r2"], None,
                     {"r1": [0.5, 0.1, 1.0, 0.05], "r2": [1.0, 0.4, 1.9, 0.1]}, ("r1", "r2"),
                     lambda d, p: d == 0),
    # vectors: a per-head one is [Hq, K], a shared one [K], a shared scalar a 0-d value
    "t5": (_t5(False), None, {"w": _pattern(4, 32)}, ("w",), None),
    "t5_bidirectional": (_t5(True), None, {"w": _pattern(4, 32, shift=0.3)}, ("w",), None),
    "sandwich": (_sandwich, None, {"a": [0.05, 0.01, 0.2, 0.002]}, ("a",), None),
    # FoX's log-prior over token positions (its use is over position tensors: test_positions.py)
    "forget_gate": (lambda d, p: d, None, {}, (), None),
    "fire": (_fire, None, {"c": 0.3, "L": 8.0, "w1": _pattern(1, 32, 2.0)[0],
                           "b1": _pattern(1, 32, 1.0, 0.5)[0], "w2": _pattern(4, 32, 0.5, 1.0),
                           "b2": [0.1, -0.2, 0.3, 0.0]},
             ("c", "L", "w1", "b1", "w2", "b2"), None),
}


def test_library_is_all_shipped():
    """(alibi_2d reads two position channels, given as tensors: tests/runtime/test_positions.py)"""
    from bamgen.resources import shipped_priors
    shipped = {p.stem for p in shipped_priors()}
    assert set(LIBRARY) | {"uniform", "laplace", "generalized_gaussian", "alibi_2d"} == shipped


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_shipped_prior_matches_reference(name, backend):
    _check_against_reference(name, backend)


@pytest.mark.parametrize("family", ["sm_90", "sm_80"])
@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_shipped_prior_with_a_gpu_family_s_tiles(name, family, monkeypatch):
    """The kernels with the tiles, table read and dQ groups a GPU of that family launches
    (BAMGEN_INTERPRET_TILES), run by the interpreter against the reference: the tile logic of
    a GPU's launch (query tiles of 128 rows over 29 queries, the halved tiles, FIRE's groups of
    8) on the CPU, which the interpreter's small tiles do not reach."""
    from bamgen.runtime.triton import launch
    if DEVICE.type != "cpu":
        pytest.skip("a GPU runs its own tiles (test_shipped_prior_matches_reference)")
    monkeypatch.setenv("BAMGEN_INTERPRET_TILES", family)
    families, real = [], launch.candidates
    monkeypatch.setattr(launch, "candidates",
                        lambda prior, kernel, head_dim, arch, masked=False, tma=False:
                        families.append(arch) or real(prior, kernel, head_dim, arch, masked, tma))
    _check_against_reference(name, "triton")
    assert families and set(families) == {family}


def test_fma_row_sums_of_a_gpu_launch_match_the_reference(monkeypatch):
    """A GPU sums SSMax's per-tile parameter terms through a one-FFMA tl.reduce combine
    (helpers._row_dot, _ROW_DOT_FMA), which the interpreter replaces by tl.sum for speed: here
    the interpreter runs that combine, with sm_90's 64x32 dQ tile (TILE_GRAD_SUMS), against
    the reference; a combine that drops its second operand fails the same check, so the
    combine is what ran."""
    import triton
    import triton.language as tl
    from bamgen.runtime.triton import helpers
    if DEVICE.type != "cpu":
        pytest.skip("a GPU runs the combine itself (test_shipped_prior_matches_reference)")
    monkeypatch.setenv("BAMGEN_INTERPRET_TILES", "sm_90")
    monkeypatch.setattr(helpers, "_ROW_DOT_FMA", tl.constexpr(True))

    @triton.jit
    def drops_second(x1, w1, x2, w2):
        return x1 * w1, tl.full(x1.shape, 1.0, tl.float32)
    # a prior's kernels bind the helpers when first made (variant.instantiate): made afresh
    # for each check, and the earlier ones back in place after the test
    prior = importlib.import_module("generated.bam_ssmax")._prior
    real = helpers._fma_pair
    monkeypatch.setattr(helpers, "_fma_pair", drops_second)
    monkeypatch.setattr(prior, "_kernels", None)
    with pytest.raises(AssertionError, match=r"dssmax: [^\n]* FAIL"):
        _check_against_reference("bam_ssmax", "triton")
    monkeypatch.setattr(helpers, "_fma_pair", real)
    monkeypatch.setattr(prior, "_kernels", None)
    _check_against_reference("bam_ssmax", "triton")


@pytest.mark.parametrize("family, head_dim, read", [("sm_90", 32, "prefetch"), ("sm_90", 128, "prefetch"),
                                                    ("sm_80", 64, "async"), (None, 64, "async")])
def test_an_interpreted_family_chooses_the_read_and_the_groups(family, head_dim, read, monkeypatch):
    """Under the interpreter, BAMGEN_INTERPRET_TILES gives the family's forward read (by head-dim
    bucket) and dQ groups (FIRE's 99 scalars: 8 a launch on a GPU, 4 masked), else the
    interpreter's (async, 16 a launch)."""
    from bamgen.runtime.triton import launch
    if family is None:
        monkeypatch.delenv("BAMGEN_INTERPRET_TILES", raising=False)
    else:
        monkeypatch.setenv("BAMGEN_INTERPRET_TILES", family)
    assert launch.table_gather(torch.device("cpu"), head_dim) == read
    assert launch.table_gather() == "async"   # (the decode kernel's)
    calls = []
    monkeypatch.setattr(launch, "grad_groups", lambda n, kind, size, masked: calls.append(size) or [(0, n)])
    fire = importlib.import_module("generated.fire")
    q, k, v = (torch.randn(1, 2, 5, 16, requires_grad=True) for _ in range(3))
    params = {n: t.requires_grad_() for n, t in fire.default_params(2).items()}
    fire.attention(q, k, v, causal=True, backend="triton", **params).sum().backward()
    assert calls == [launch.INTERPRET_GRAD_GROUP if family is None else None]


def test_a_bad_interpreted_family_is_named(monkeypatch):
    from bamgen.runtime.triton import launch
    monkeypatch.setenv("BAMGEN_INTERPRET_TILES", "sm_70")
    with pytest.raises(ValueError, match="BAMGEN_INTERPRET_TILES='sm_70': give one of sm_80, sm_90"):
        launch.interpreted_family()


@pytest.mark.parametrize("dq_tile", [(64, 32, 4, 1), (64, 64, 4, 1)])
def test_ssmax_dq_with_per_tile_parameter_sums(dq_tile, monkeypatch):
    """SSMax's dQ kernel reduces the parameters' sums per key tile where a tile has 2048 scores
    or more (TILE_GRAD_SUMS: sm_90's 64x32), and per score below (the interpreter's default
    32x16 tile, which the other tests run): both paths against the reference."""
    monkeypatch.delenv("BAMGEN_INTERPRET_TILES", raising=False)   # (the interpreter's tiles)
    monkeypatch.setitem(INTERPRET_TILES, "bwd_dq", dq_tile)
    _check_against_reference("bam_ssmax", "triton")


@pytest.mark.parametrize("group", [1, 2])
def test_dq_launches_in_groups_give_the_one_launch_gradients(group, monkeypatch):
    """A prior with more learnable scalars than a dQ launch sums takes a launch per group
    (FIRE's 134 in a two-head test, 8 a launch on a GPU, 4 with masks, 16 under the
    interpreter): GGD's three, one or two a launch (the last group ragged). dQ, dK, dV and the
    first group's gradients are one launch's bit for bit; the later groups weigh each score by
    dS - rowsum(dS) P with the row sums the first launch wrote (DS_ROWS_KNOWN), the same sum
    in another order: within float32 rounding of one launch's, and within the reference's
    tolerance (docs/performance.md, "FIRE's later groups"). (The test below shows that the
    later launches read the right rows' sums: this one could not tell.)"""
    import generated.generalized_gaussian as ggd
    from bamgen.runtime.triton import launch

    def grads():
        g = torch.Generator().manual_seed(3)
        q = torch.randn(1, 2, 37, 16, generator=g, requires_grad=True)
        k, v = (torch.randn(1, 1, 37, 16, generator=g, requires_grad=True) for _ in range(2))
        params = {n: t.clone().requires_grad_() for n, t in ggd.default_params(2).items()}
        out = ggd.attention(q, k, v, causal=True, backend="triton", **params)
        return torch.autograd.grad(out, [q, k, v, *params.values()], torch.randn(out.shape, generator=g))

    monkeypatch.delenv("BAMGEN_INTERPRET_TILES", raising=False)   # (the interpreter's groups)
    want = grads()
    monkeypatch.setattr(launch, "INTERPRET_GRAD_GROUP", group)
    launched, real = [], launch.grad_groups
    monkeypatch.setattr(launch, "grad_groups", lambda *a: launched.append(real(*a)) or launched[-1])
    got = grads()
    assert launched == [[(0, 1), (1, 1), (2, 1)] if group == 1 else [(0, 2), (2, 1)]]
    first = 3 + group   # q, k, v and the first group's scalars (one per head in each tensor)
    for g, w in zip(got[:first], want[:first], strict=True):
        assert torch.equal(g, w)
    for g, w in zip(got[first:], want[first:], strict=True):
        assert not torch.equal(g, torch.zeros_like(g))
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6 * float(w.abs().max()))
    if group == 1:
        _check_against_reference("gaussian", "triton")   # (mu, then sigma from the row sums)


class _ShiftedDelta:
    """The dQ kernel, launched with each row's delta moved by a constant of its own."""

    def __init__(self, kernel, shift):
        self.kernel, self.shift = kernel, shift

    def __getitem__(self, grid):
        run = self.kernel[grid]

        def launch(*args, **kwargs):
            args = list(args)
            args[7] = args[7] + self.shift(args[7])   # (Q, K, V, Theta, DO, Mrow, Lrow, Delta, ...)
            return run(*args, **kwargs)
        return launch


@pytest.mark.parametrize("name, group, shape", [("generalized_gaussian", 1, (2, 2, 37, 16)),
                                                 ("fire", 16, (1, 2, 21, 16))])
def test_later_groups_read_their_rows_sums_of_ds(name, group, shape, monkeypatch):
    """Moving a row's delta by c moves its dS by -c P and its sum of dS by -c (P sums to 1),
    which the row's correction cancels: the parameters' gradients do not move, in every
    launch, if and only if the later launches weigh their scores with the sums the first
    launch wrote for the same rows: read as 0, or from another head's rows, they fail here."""
    from bamgen.runtime.triton import launch

    module = importlib.import_module(f"generated.{name}")
    monkeypatch.delenv("BAMGEN_INTERPRET_TILES", raising=False)
    monkeypatch.setattr(launch, "INTERPRET_GRAD_GROUP", group)

    torch.manual_seed(5)
    initial = module.default_params(shape[1])   # (FIRE's are drawn: once, for both calls)

    def param_grads():
        g = torch.Generator().manual_seed(5)
        B, H, N, D = shape
        q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
        params = {n: t.clone().requires_grad_() for n, t in initial.items()}
        out = module.attention(q, k, v, causal=True, backend="triton", **params)
        return torch.autograd.grad(out, list(params.values()), torch.randn(out.shape, generator=g))

    want = param_grads()
    variant = module._prior.kernels()
    shifted = _ShiftedDelta(variant["bwd_dq"],
                            lambda d: torch.linspace(-3.0, 5.0, d.numel()).reshape(d.shape))
    shifted = dataclasses.replace(variant, kernels={**variant.kernels, "bwd_dq": shifted})
    monkeypatch.setattr(module._prior, "kernels", lambda: shifted)
    got = param_grads()
    assert len(launch.grad_groups(module._prior.traits.num_grads, size=group)) >= 3
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * float(w.abs().max()))


# BAMGEN_TEST_DEVICE=cuda (make gpu-check) runs the Triton checks on a GPU, as in
# tests/runtime/test_properties.py; the reference stays float64 on the CPU
DEVICE = torch.device(os.environ.get("BAMGEN_TEST_DEVICE", "cpu"))


def as_reference(module, params):
    """Parameters as the reference takes them: a vector as [heads, K] ([1, K] when the heads
    share it)."""
    return {n: t[None] if t.dim() == 1 and module.TRAITS.param(n).size else t
            for n, t in params.items()}


def fold_shared(module, *results):
    """The reference gives per-head gradients: a value the heads share has their sum (its
    gradient's gross magnitude too)."""
    for r in results:
        shared = {n for n in r.dparams if not module.TRAITS.param(n).per_head}
        r.dparams = {n: g.sum(0) if n in shared else g for n, g in r.dparams.items()}
        for n in shared:
            if r.gross.get("d" + n) is not None:
                r.gross["d" + n] = r.gross["d" + n].sum(0)


def _check_against_reference(name, backend):
    log_prior, score, values, learnable, kink = LIBRARY[name]
    dev = DEVICE if backend == "triton" else torch.device("cpu")
    module = importlib.import_module(f"generated.{name}")
    assert module.LEARNABLE == learnable
    torch.manual_seed(11)
    B, Hq, Hk, Nq, Nk, D = 1, 4, 2, 29, 45, 32
    q, k, v = torch.randn(B, Hq, Nq, D), torch.randn(B, Hk, Nk, D), torch.randn(B, Hk, Nk, D)
    dout = torch.randn(B, Hq, Nq, D)
    params = {n: torch.tensor(vals) for n, vals in values.items()}
    leaves = [t.clone().to(dev).requires_grad_() for t in (q, k, v)]
    p_leaves = {n: t.clone().to(dev).requires_grad_(n in learnable) for n, t in params.items()}
    out = module.attention(*leaves, **p_leaves, causal=True, q_offset=Nk - Nq, backend=backend)
    wrt = leaves + [p_leaves[n] for n in learnable]
    out, *grads = (t.cpu() for t in (out, *torch.autograd.grad(out, wrt, dout.to(dev))))
    kw = dict(causal=True, q_offset=Nk - Nq, score=score, kink=kink, dout=dout)
    ref = reference_attention(q, k, v, as_reference(module, params), log_prior, **kw)
    pt = reference_attention(q, k, v, as_reference(module, params), log_prior,
                             compute_dtype=torch.float32, **kw)
    fold_shared(module, ref, pt)
    results = [("out", out, ref.out, pt.out), ("dq", grads[0], ref.dq, pt.dq),
               ("dk", grads[1], ref.dk, pt.dk), ("dv", grads[2], ref.dv, pt.dv)]
    results += [(f"d{n}", g, ref.dparams[n], pt.dparams[n]) for n, g in zip(learnable, grads[3:])]
    assert all(torch.isfinite(g).all() for _, g, _, _ in results)
    assert_all_close(results, torch.float32, context=f"{name} {backend}")


def test_buffers_get_no_gradient():
    bam = importlib.import_module("generated.bam")
    q = torch.randn(1, 2, 5, 16)
    tm = torch.zeros(2, requires_grad=True)
    out = bam.attention(q, q, q, ta=-1.0, tb=1.0, tm=tm)
    assert not out.requires_grad or torch.autograd.grad(out.sum(), tm, allow_unused=True)[0] is None
