"""Hypothesis property tests of the generated modules against the naive reference.

Every case draws a prior, shapes (ragged lengths, Nq != Nk, GQA/MQA, head dims including 80),
a dtype, causal or not, position offsets (including rows that see no key), and prior-parameter
values across their domains (including ``mu`` exactly on an integer so that ``d == mu`` occurs,
``beta < 1`` and ``beta > 1``).  It runs the generated ``attention`` on the "torch" or "triton"
backend (the latter under ``TRITON_INTERPRET=1``, set in conftest.py), and checks the output, dq,
dk, dv and every parameter gradient with the tolerance of docs/architecture.md, "Testing" (tests/tolerance.py),
that all of them are finite, and that rows with no visible key give exactly 0.

The priors are written here again as float64 torch callables, independently of the compiler.

Example counts: the "bamgen-ci" Hypothesis profile (default) keeps the file to a few minutes on
two cores; ``BAMGEN_HYPOTHESIS_PROFILE=bamgen-long`` runs ten times as many examples.
"""
from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.reference import reference_attention
from tests.tolerance import assert_all_close, verdict

FLOAT32_MAX = torch.finfo(torch.float32).max

# --------------------------------------------------------------------------------------------
# Hypothesis profiles

_COMMON = dict(
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
settings.register_profile("bamgen-ci", max_examples=10, **_COMMON)
settings.register_profile("bamgen-long", max_examples=100, **_COMMON)
PROFILE = os.environ.get("BAMGEN_HYPOTHESIS_PROFILE", "bamgen-ci")
_BASE = settings.get_profile(PROFILE)
# per-test example counts, as multiples of the profile's max_examples
TORCH_SETTINGS = settings(_BASE, max_examples=10 * _BASE.max_examples)
# The Triton interpreter takes ~1 s an example, and shrinking a failure can take Hypothesis's
# full five-minute shrink budget per test; the ci profile therefore reports the first failing
# example as drawn (it is fully described by its Case, seed included, and by the printed
# @reproduce_failure blob).  The long profile shrinks.
TRITON_SETTINGS = settings(
    _BASE, max_examples=2 * _BASE.max_examples,
    phases=[p for p in Phase if p != Phase.shrink] if PROFILE == "bamgen-ci" else list(Phase))

# --------------------------------------------------------------------------------------------
# the priors, written independently of the compiler


@dataclass(frozen=True)
class PriorDef:
    name: str
    cls: str
    log_prior: Optional[Callable]
    kink: Optional[Callable]
    params: tuple  # parameter names
    inits: dict = field(default_factory=dict)  # name -> f(h, H)


def alibi_slopes(n: int) -> list[float]:
    """ALiBi's head slopes as its paper's code makes them (Press et al., get_slopes): a
    geometric series from 2^(-8/n) for n a power of two; otherwise the closest power of two's
    slopes, then every other slope of twice that many heads."""
    if math.log2(n).is_integer():
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]
    closest = 2 ** math.floor(math.log2(n))
    return alibi_slopes(closest) + alibi_slopes(2 * closest)[0::2][:n - closest]


PRIORS = {
    "uniform": PriorDef("uniform", "UniformAttention", None, None, ()),
    "laplace": PriorDef(
        "laplace", "LaplaceAttention",
        lambda d, p: -torch.abs(d) / p["b"],
        lambda d, p: d == 0,
        ("b",),
        {"b": lambda h, H: 1 / alibi_slopes(H)[h]},
    ),
    "generalized_gaussian": PriorDef(
        "generalized_gaussian", "GeneralizedGaussianAttention",
        lambda d, p: -(torch.abs(d - p["mu"]) / p["alpha"]) ** p["beta"],
        lambda d, p: (d - p["mu"]) == 0,
        ("alpha", "beta", "mu"),
        {"alpha": lambda h, H: 2 ** (8 * (h + 1) / H), "beta": lambda h, H: 1.0, "mu": lambda h, H: 0.0},
    ),
}
PRIOR_NAMES = list(PRIORS)


def load(prior_name: str):
    try:
        return importlib.import_module(f"generated.{prior_name}")
    except ModuleNotFoundError as e:  # a missing generated module is a failure, not a skip
        raise AssertionError(f"generated/{prior_name}.py is missing or broken: {e}") from e


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# BAMGEN_TEST_DEVICE=cuda (make gpu-check) runs the generated modules on a GPU: the tensors are
# drawn on the CPU as always (same values for the same seed), moved to the device for the module
# and back for the comparison; the float64 reference always runs on the CPU.
DEVICE = torch.device(os.environ.get("BAMGEN_TEST_DEVICE", "cpu"))

# --------------------------------------------------------------------------------------------
# one case


@dataclass
class Case:
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
    q_offset: int
    k_offset: int
    params: dict  # name -> list of Hq floats (float32-representable)
    param_form: dict = field(default_factory=dict)  # name -> "tensor" (requires grad) | "float"
    scale: Optional[float] = None
    seed: int = 0

    def short(self) -> str:
        p = {k: [float(f"{x:.6g}") for x in v] for k, v in self.params.items()}
        return (f"{self.prior}/{self.backend}/{self.dtype} B={self.B} Hq={self.Hq} Hk={self.Hk} Nq={self.Nq} "
                f"Nk={self.Nk} D={self.D} causal={self.causal} q_offset={self.q_offset} k_offset={self.k_offset} "
                f"scale={self.scale} seed={self.seed} params={p} forms={self.param_form}")


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def run_case(case: Case, check=assert_all_close):
    """Run one case and hold every result to the reference (``check``: assert_all_close, or
    a function of the same arguments that returns what it found)."""
    prior = PRIORS[case.prior]
    mod = load(case.prior)
    dtype = DTYPES[case.dtype]
    g = torch.Generator().manual_seed(case.seed)

    def draw(*shape):  # rounded to the test dtype first
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)

    q = draw(case.B, case.Hq, case.Nq, case.D)
    k = draw(case.B, case.Hk, case.Nk, case.D)
    v = draw(case.B, case.Hk, case.Nk, case.D)
    dout = draw(case.B, case.Hq, case.Nq, case.D)

    kparams, ref_params = {}, {}
    for name in prior.params:
        vals = torch.tensor(case.params[name], dtype=torch.float32)
        ref_params[name] = vals
        if case.param_form.get(name, "tensor") == "float":
            assert bool((vals == vals[0]).all())
            kparams[name] = float(vals[0])
        else:
            kparams[name] = vals.clone().to(DEVICE).requires_grad_(True)

    qk, kk, vk = (t.clone().to(DEVICE).requires_grad_(True) for t in (q, k, v))
    kw = dict(causal=case.causal, scale=case.scale, q_offset=case.q_offset, k_offset=case.k_offset)
    out = mod.attention(qk, kk, vk, **kparams, backend=case.backend, **kw)
    assert out.dtype == dtype and out.shape == q.shape, (out.dtype, out.shape)
    assert out.device == qk.device, (out.device, qk.device)
    out.backward(dout.to(DEVICE))

    rkw = dict(kw, score=None, kink=prior.kink, dout=dout)
    ref = reference_attention(q, k, v, ref_params, prior.log_prior, **rkw)
    pt = reference_attention(q, k, v, ref_params, prior.log_prior, compute_dtype=dtype, **rkw)

    ctx = case.short()
    got = {"out": out.detach(), "dq": qk.grad, "dk": kk.grad, "dv": vk.grad}
    for name in prior.params:
        if isinstance(kparams[name], torch.Tensor):
            got["d" + name] = kparams[name].grad
    # a parameter gradient beyond float32's range (next to a kink of a prior with beta < 1; the
    # reference applies the kernels' clamped derivatives: reference._float32_derivatives) is
    # +-inf when rounded to float32: it and the result are compared saturated at +-3.4e38
    beyond = {"d" + name: ref.dparams[name].abs() > FLOAT32_MAX for name in prior.params}
    for name, t in got.items():
        assert t is not None, f"{name} has no gradient; case: {ctx}"
        got[name] = t.cpu()
        finite = torch.isfinite(got[name]) | beyond.get(name, False)
        assert bool(finite.all()), f"{name} is not finite; case: {ctx}"
    assert qk.grad.dtype == dtype and kk.grad.dtype == dtype and vk.grad.dtype == dtype

    empty = ref.empty_rows
    if bool(empty.any()):
        # empty [B, Nq]: the rows of every head
        assert bool((got["out"].transpose(1, 2)[empty] == 0).all()), f"no-visible-key rows are not exactly 0; case: {ctx}"
        assert bool((got["dq"].transpose(1, 2)[empty] == 0).all()), f"dq of no-visible-key rows is not 0; case: {ctx}"

    results = [("out", got["out"], ref.out, pt.out, ref.gross["out"]),
               ("dq", got["dq"], ref.dq, pt.dq, ref.gross["dq"]),
               ("dk", got["dk"], ref.dk, pt.dk, ref.gross["dk"]),
               ("dv", got["dv"], ref.dv, pt.dv, ref.gross["dv"])]
    saturated = lambda t: t.double().clamp(-FLOAT32_MAX, FLOAT32_MAX)   # noqa: E731 (NaN stays)
    for name in prior.params:
        if "d" + name in got:
            results.append(("d" + name, saturated(got["d" + name]), saturated(ref.dparams[name]),
                            saturated(pt.dparams[name]), ref.gross["d" + name]))
    return check(results, dtype, context=ctx)


# --------------------------------------------------------------------------------------------
# strategies

LENGTHS = [1, 2, 16, 17, 32, 64, 81, 123, 128]
HEAD_DIMS = [16, 32, 64, 80, 128]


def _log_uniform(lo, hi):
    return st.floats(math.log2(lo), math.log2(hi)).map(lambda e: 2.0 ** e)


PARAM_VALUES = {
    # positive scales: ALiBi-like inits 2**(8(h+1)/H), small and large
    "b": st.one_of(st.sampled_from([0.5, 1.0, 2.0, 4.0, 16.0, 256.0]), _log_uniform(0.5, 300.0)),
    "alpha": st.one_of(st.sampled_from([0.5, 1.0, 2.0, 4.0, 16.0, 256.0]), _log_uniform(0.5, 300.0)),
    # shape: beta -> 0, beta < 1, Laplace, Gaussian, beta > 2
    "beta": st.one_of(st.sampled_from([0.05, 0.3, 0.5, 1.0, 1.5, 2.0, 3.0]), st.floats(0.05, 3.0)),
    # location: exact integers (d == mu happens) and arbitrary reals
    "mu": st.one_of(st.integers(-6, 6).map(float), st.floats(-10.0, 10.0)),
}


@st.composite
def cases(draw, prior: str, backend: str):
    dtype = draw(st.sampled_from(list(DTYPES)))
    B = draw(st.sampled_from([1, 2]))
    Hq = draw(st.sampled_from([4, 4, 2, 1]))
    Hk = draw(st.sampled_from([h for h in (1, 2, 4) if Hq % h == 0]))
    Nq = draw(st.sampled_from(LENGTHS))
    Nk = draw(st.sampled_from(LENGTHS))
    D = draw(st.sampled_from(HEAD_DIMS))
    causal = draw(st.booleans())
    offsets = draw(st.sampled_from(["zero", "bottom_right", "free"]))
    if offsets == "zero":
        q_offset, k_offset = 0, 0
    elif offsets == "bottom_right":  # chunked prefill / decode: the last query sees the last key
        q_offset, k_offset = max(Nk - Nq, 0), max(Nq - Nk, 0)
    else:  # includes rows with no visible key when causal and q_offset < k_offset
        q_offset = draw(st.sampled_from([0, 1, 5, 17, 64]))
        k_offset = draw(st.sampled_from([0, 3, 17, 40]))
    pdef = PRIORS[prior]
    params, forms = {}, {}
    for name in pdef.params:
        form = draw(st.sampled_from(["tensor", "tensor", "tensor", "float"]))
        if form == "float":
            vals = [draw(PARAM_VALUES[name])] * Hq
        else:
            vals = draw(st.lists(PARAM_VALUES[name], min_size=Hq, max_size=Hq))
        params[name] = [_f32(x) for x in vals]
        forms[name] = form
    scale = draw(st.sampled_from([None, None, None, 0.3]))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    return Case(prior, backend, dtype, B, Hq, Hk, Nq, Nk, D, causal, q_offset, k_offset, params, forms, scale, seed)


@pytest.mark.parametrize("prior", PRIOR_NAMES)
@TORCH_SETTINGS
@given(data=st.data())
def test_torch_backend_matches_reference(prior, data):
    run_case(data.draw(cases(prior, "torch"), label="case"))


@pytest.mark.parametrize("prior", PRIOR_NAMES)
@TRITON_SETTINGS
@given(data=st.data())
def test_triton_backend_matches_reference(prior, data):
    run_case(data.draw(cases(prior, "triton"), label="case"))


# --------------------------------------------------------------------------------------------
# fixed hard cases (reproducible)


def _ggd(alpha, beta, mu, Hq=4):
    return {"alpha": [_f32(alpha)] * Hq if not isinstance(alpha, list) else [_f32(x) for x in alpha],
            "beta": [_f32(beta)] * Hq if not isinstance(beta, list) else [_f32(x) for x in beta],
            "mu": [_f32(mu)] * Hq if not isinstance(mu, list) else [_f32(x) for x in mu]}


HARD_CASES = {
    # a parameter gradient beyond float32's range: mu a subnormal 4e-44, beta 0.05, so
    # |d - mu| ** (beta - 1) ~ 1e40 at d = 0 (found by the property tests; both D's draws)
    "mu_subnormal_beta005_d16": dict(prior="generalized_gaussian", dtype="fp32", B=1, Hq=1, Hk=1, Nq=1,
                                     Nk=2, D=16, causal=False, q_offset=0, k_offset=0, seed=0,
                                     params=_ggd(0.5, 0.05, 3.783505853677006e-44, Hq=1)),
    "mu_subnormal_beta005_d32": dict(prior="generalized_gaussian", dtype="fp32", B=1, Hq=1, Hk=1, Nq=1,
                                     Nk=2, D=32, causal=False, q_offset=0, k_offset=0, seed=0,
                                     params=_ggd(0.5, 0.05, 3.783505853677006e-44, Hq=1)),
    # single query, single key
    "n1_ggd": dict(prior="generalized_gaussian", dtype="fp32", B=1, Hq=4, Hk=4, Nq=1, Nk=1, D=16, causal=True,
                   q_offset=0, k_offset=0, params=_ggd(1.0, 0.3, 0.0)),
    "n1_noncausal_laplace": dict(prior="laplace", dtype="fp16", B=2, Hq=4, Hk=1, Nq=1, Nk=1, D=80, causal=False,
                                 q_offset=0, k_offset=0, params={"b": [1.0, 2.0, 4.0, 8.0]}),
    # d == mu on the visible part with beta < 1 (infinite derivative times zero sign)
    "kink_beta03": dict(prior="generalized_gaussian", dtype="fp32", B=2, Hq=4, Hk=2, Nq=17, Nk=17, D=32,
                        causal=True, q_offset=0, k_offset=0, params=_ggd([1.0, 2.0, 4.0, 16.0], 0.3, [0.0, 1.0, 3.0, 5.0])),
    "kink_beta03_noncausal_negmu": dict(prior="generalized_gaussian", dtype="bf16", B=1, Hq=4, Hk=4, Nq=33, Nk=20,
                                        D=64, causal=False, q_offset=0, k_offset=0,
                                        params=_ggd([0.5, 3.0, 8.0, 64.0], [0.3, 0.05, 0.5, 0.9], [-4.0, 0.0, 2.0, -1.0])),
    # beta -> 0
    "beta_small": dict(prior="generalized_gaussian", dtype="fp16", B=1, Hq=4, Hk=1, Nq=81, Nk=123, D=16,
                       causal=True, q_offset=42, k_offset=0, params=_ggd(4.0, 0.05, 2.0)),
    # beta > 1 at the kink (differentiable there)
    "kink_beta25": dict(prior="generalized_gaussian", dtype="fp32", B=1, Hq=4, Hk=4, Nq=64, Nk=64, D=128,
                        causal=True, q_offset=0, k_offset=0, params=_ggd([2.0, 8.0, 32.0, 128.0], 2.5, 3.0)),
    # MQA with ALiBi initial slopes, ragged
    "mqa_laplace": dict(prior="laplace", dtype="bf16", B=2, Hq=4, Hk=1, Nq=123, Nk=81, D=80, causal=True,
                        q_offset=0, k_offset=0, params={"b": [4.0, 16.0, 64.0, 256.0]}),
    # rows with no visible key (causal, q_offset < k_offset)
    "empty_rows_ggd": dict(prior="generalized_gaussian", dtype="fp32", B=2, Hq=4, Hk=2, Nq=17, Nk=33, D=32,
                           causal=True, q_offset=0, k_offset=5, params=_ggd(2.0, 0.3, 0.0)),
    "empty_rows_uniform": dict(prior="uniform", dtype="fp16", B=1, Hq=2, Hk=1, Nq=81, Nk=17, D=64, causal=True,
                               q_offset=3, k_offset=40, params={}),
    "all_rows_empty": dict(prior="laplace", dtype="fp32", B=1, Hq=4, Hk=4, Nq=16, Nk=16, D=16, causal=True,
                           q_offset=0, k_offset=17, params={"b": [1.0, 2.0, 3.0, 4.0]}),
    # decode: one query at the end of a long cache
    "decode_ggd": dict(prior="generalized_gaussian", dtype="bf16", B=2, Hq=4, Hk=1, Nq=1, Nk=128, D=128,
                       causal=True, q_offset=127, k_offset=0, params=_ggd([2.0, 8.0, 32.0, 128.0], [0.3, 1.0, 1.5, 2.0], 1.0)),
    # Nq > Nk non-causal with a custom scale
    "noncausal_scale": dict(prior="uniform", dtype="fp32", B=2, Hq=4, Hk=2, Nq=130, Nk=17, D=80, causal=False,
                            q_offset=0, k_offset=0, params={}, scale=0.3),
    # keys far from the prior's mode: |logit| ~ 1e3..1.6e4 on every visible key of a row
    "far_mode_large_logits": dict(prior="generalized_gaussian", dtype="fp32", B=1, Hq=4, Hk=4, Nq=123, Nk=16,
                                  D=64, causal=False, q_offset=1, k_offset=0, scale=0.3, seed=1048575,
                                  params=_ggd(1.0, [0.85884, 0.3, 0.85884, 2.0], [-2.80147, 4.0, 0.0, -5.0])),
    "far_mode_beta3": dict(prior="generalized_gaussian", dtype="fp32", B=1, Hq=4, Hk=2, Nq=123, Nk=32, D=128,
                           causal=False, q_offset=0, k_offset=0, scale=0.3, seed=1446,
                           params=_ggd([1.0, 51.5509, 0.684987, 1.25992], 3.0, [-4.0, 0.333329, 0.0, -2.85264])),
    "far_mode_two_keys": dict(prior="generalized_gaussian", dtype="fp32", B=1, Hq=4, Hk=1, Nq=64, Nk=2, D=16,
                              causal=False, q_offset=0, k_offset=62, seed=0, params=_ggd(0.5, 1.5, 0.0)),
    # few keys, sharp prior, half precision: delta = rowsum(dO * O) must not use the rounded O
    "fp16_sharp_laplace_two_keys": dict(prior="laplace", dtype="fp16", B=1, Hq=4, Hk=1, Nq=123, Nk=2, D=16,
                                        causal=True, q_offset=0, k_offset=0, seed=0, params={"b": [0.5] * 4}),
    "fp16_laplace_far_keys": dict(prior="laplace", dtype="fp16", B=1, Hq=1, Hk=1, Nq=1, Nk=2, D=16, causal=False,
                                  q_offset=0, k_offset=3, seed=0, params={"b": [0.5]}),
    # biases of hundreds of nats in base 2 (the GPU table holds log2(e) * log_prior): a fold of
    # log2(e) in float32 once moved dV by 1.2e-4 (bound 7.5e-5) at these parameters
    "log2_table_ggd_beta3": dict(prior="generalized_gaussian", dtype="fp32", B=1, Hq=4, Hk=2, Nq=65,
                                 Nk=65, D=64, causal=True, q_offset=0, k_offset=0, seed=3,
                                 params=_ggd([0.5, 0.7, 2.0, 8.0], 3.0, [-4.0, -4.0, 0.0, 30.0])),
    "bf16_uniform_tiny": dict(prior="uniform", dtype="bf16", B=1, Hq=1, Hk=1, Nq=2, Nk=2, D=32, causal=False,
                              q_offset=0, k_offset=0, seed=285801718, params={}),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", list(HARD_CASES))
def test_hard_case(name, backend):
    spec = dict(HARD_CASES[name])
    spec.setdefault("seed", 1234)
    run_case(Case(backend=backend, **spec))


@pytest.mark.parametrize("family", ["sm_90", "sm_80"])
@pytest.mark.parametrize("name", list(HARD_CASES))
def test_difficult_cases_with_a_gpu_family_s_tiles(name, family, monkeypatch):
    """The hard cases (NoPE, ALiBi and GGD among them, fp16 and bf16 too) on the Triton kernels
    with the tiles, table read and dQ groups a GPU of that family launches
    (BAMGEN_INTERPRET_TILES), run by the interpreter; a GPU runs its own (test_hard_case)."""
    if DEVICE.type != "cpu":
        pytest.skip("a GPU runs its own tiles (test_hard_case)")
    monkeypatch.setenv("BAMGEN_INTERPRET_TILES", family)
    spec = dict(HARD_CASES[name])
    spec.setdefault("seed", 1234)
    run_case(Case(backend="triton", **spec))


def test_hard_case_float_params():
    """Parameters passed as python floats instead of [Hq] tensors."""
    spec = dict(HARD_CASES["kink_beta03"], params=_ggd(2.0, 0.3, 1.0))
    run_case(Case(backend="torch", seed=7, param_form={"alpha": "float", "beta": "float", "mu": "float"}, **spec))


# --------------------------------------------------------------------------------------------
# metadata, default_params and the nn.Module


@pytest.mark.parametrize("prior", PRIOR_NAMES)
@pytest.mark.parametrize("H", [1, 4, 7, 12, 24])
def test_default_params_match_inits(prior, H):
    """The shipped inits, ALiBi's slopes included at head counts that are not a power of two
    (12: 1/b starts 0.5, 0.25, ..., 0.707, 0.354, as ALiBi's code, where 2^(-8(h+1)/H) would
    start 0.63, 0.40, ...)."""
    mod = load(prior)
    pdef = PRIORS[prior]
    dp = mod.default_params(H)
    assert set(dp) == set(pdef.params)
    for name in pdef.params:
        t = dp[name]
        assert t.dtype == torch.float32 and t.shape == (H,)
        want = torch.tensor([pdef.inits[name](h, H) for h in range(H)], dtype=torch.float32)
        torch.testing.assert_close(t, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("prior", PRIOR_NAMES)
def test_prior_metadata(prior):
    meta = load(prior).PRIOR
    for key in ("name", "description", "log_prior", "score", "params", "bamgen_version", "source_hash"):
        assert key in meta, key
    assert meta["name"] == prior
    assert set(meta["params"]) == set(PRIORS[prior].params)
    for name, info in meta["params"].items():
        for key in ("init", "domain", "learnable", "per_head"):
            assert key in info, (name, key)


@pytest.mark.parametrize("prior", ["generalized_gaussian", "laplace"])
def test_triton_gradients_are_bit_identical_run_to_run(prior):
    """No atomics anywhere in the backward: dK/dV belong to one program each, the dQ kernel
    writes one partial sum per program that the host adds in a fixed order, and the row sums
    reduce in a fixed tree. Two backward passes of the same inputs give the same bits for dq,
    dk, dv and every parameter gradient (bf16, GQA, ragged, causal; GGD: the table path with
    three parameters, ALiBi: the causal ramp)."""
    mod = load(prior)
    g = torch.Generator().manual_seed(5)
    B, Hq, Hk, N, D = 2, 4, 2, 37, 32
    q, dout = (torch.randn(B, Hq, N, D, generator=g).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, Hk, N, D, generator=g).to(torch.bfloat16) for _ in range(2))

    def grads():
        qk, kk, vk = (t.clone().to(DEVICE).requires_grad_(True) for t in (q, k, v))
        prm = {n: t.clone().to(DEVICE).requires_grad_(True) for n, t in mod.default_params(Hq).items()}
        mod.attention(qk, kk, vk, **prm, causal=True, q_offset=3, backend="triton").backward(dout.to(DEVICE))
        return [qk.grad, kk.grad, vk.grad] + [t.grad for t in prm.values()]

    first, second = grads(), grads()
    assert all(t is not None for t in first)
    for a, b in zip(first, second):
        assert torch.equal(a, b) and bool(torch.isfinite(a).all())


@pytest.mark.parametrize("prior", PRIOR_NAMES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_module_initialisation_forward_backward(prior, backend):
    mod = load(prior)
    pdef = PRIORS[prior]
    H = 4
    m = getattr(mod, pdef.cls)(num_heads=H).to(DEVICE)
    learnable = [n for n, info in mod.PRIOR["params"].items() if info["learnable"]]
    if prior == "generalized_gaussian":
        assert set(learnable) == {"alpha", "beta", "mu"}
    params = [p for p in m.parameters() if p.requires_grad]
    assert len(params) == len(learnable)

    if hasattr(m, "prior_params"):  # the documented accessor of the effective values
        eff = m.prior_params()
        for name, want in mod.default_params(H).items():
            torch.testing.assert_close(eff[name].detach().float().cpu().expand(H), want, rtol=1e-6, atol=1e-6)

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, H, 33, 32, generator=g)
    k = torch.randn(2, 2, 40, 32, generator=g)
    v = torch.randn(2, 2, 40, 32, generator=g)
    dout = torch.randn(2, H, 33, 32, generator=g)
    q, k, v, dout = (t.to(DEVICE) for t in (q, k, v, dout))

    # the module's effective parameter values are default_params(H): same result as the functional form
    out = m(q, k, v, causal=True, q_offset=7, backend=backend)
    defaults = {n: t.to(DEVICE) for n, t in mod.default_params(H).items()}
    want = mod.attention(q, k, v, **defaults, causal=True, q_offset=7, backend=backend)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    # and the reference agrees with that too
    inits = {n: torch.tensor([pdef.inits[n](h, H) for h in range(H)]) for n in pdef.params}
    ref = reference_attention(q.cpu(), k.cpu(), v.cpu(), inits, pdef.log_prior, causal=True, q_offset=7,
                              kink=pdef.kink)
    torch.testing.assert_close(out.cpu().double(), ref.out, rtol=0, atol=1e-5)

    qg = q.clone().requires_grad_(True)
    out = m(qg, k, v, causal=True, q_offset=7, backend=backend)
    out.backward(dout)
    assert qg.grad is not None and bool(torch.isfinite(qg.grad).all())
    for p in params:
        assert p.grad is not None and p.grad.shape == p.shape
        assert bool(torch.isfinite(p.grad).all())
        assert bool((p.grad != 0).any())


@pytest.mark.xfail(strict=True, reason="open: the Triton dQ kernel's float32 parameter sums overflow "
                   "next to a kink (docs/reliability.md, 'An open kink case')")
def test_fp16_dmu_next_to_a_subnormal_mu_the_property_test_found():
    """Found by the property test in CI (2026-11-26; the same NaN on the code before that day's
    changes): GGD in fp16, head 1 with beta = 0.05 and mu = -1.4e-45, so |d - mu| is a denormal
    at d = 0 and d log_prior / d mu is ~3.5e41, clamped to float32's largest value in the
    distance table. The Triton dQ kernel accumulates dS times that entry in float32 per score
    and the sum meets its own overflow as inf - inf: dmu is NaN where the torch path, summing in
    float64, matches the reference. Strict: it fails once the kernel is right."""
    run_case(Case(prior="generalized_gaussian", backend="triton", dtype="fp16", B=2, Hq=4, Hk=2,
                  Nq=123, Nk=17, D=32, causal=True, q_offset=0, k_offset=106,
                  params={"alpha": [_f32(4.42977), _f32(0.707107), _f32(85.7947), 1.0],
                          "beta": [2.0, 0.05, _f32(1.44246), _f32(2.19779)],
                          "mu": [_f32(0.176196), _f32(-1.4013e-45), _f32(-0.304819), 1.0]},
                  param_form={"alpha": "tensor", "beta": "tensor", "mu": "tensor"}, seed=120024))


def test_fp32_torch_dmu_next_to_a_tiny_mu_the_property_test_found():
    """Found by the property test in CI (2026-11-26; nothing of the torch path changed that day):
    GGD in fp32 on the torch path, head 0 with beta = 0.05 and mu = 2.05e-19, a query at
    distance 0 from a key, where d log_prior / d mu is ~1.5e16. An open case that sits at its
    bound, on one side or the other by machine: dmu was 2.36e10 from the float64 reference where
    the bound allows 2.06e10 (1.15x) on that day's CI machine, and 2.05e10 (0.995x) on an
    AVX-512 machine the same evening (the torch path's float32 kernels round differently by CPU).
    So it is pinned by its ratio, not by a pass or a fail: every other result within its bound,
    dmu within 1.25x of its own (docs/reliability.md, "An open torch-path kink case"); the Triton
    path passes the same case."""
    found = run_case(Case(prior="generalized_gaussian", backend="torch", dtype="fp32", B=1, Hq=4, Hk=1,
                          Nq=2, Nk=123, D=64, causal=False, q_offset=121, k_offset=0,
                          params={"alpha": [1.0, 0.5, 0.5, 0.5], "beta": [_f32(0.05)] * 4,
                                  "mu": [2.0507318282277172e-19, 0.0, 0.0, 0.0]},
                          param_form={"alpha": "tensor", "beta": "tensor", "mu": "tensor"}, seed=161),
                     check=lambda results, dtype, context: [verdict(*r[:4], dtype, *r[4:]) for r in results])
    verdicts = {v.name: v for v in found}
    assert all(v.ok for name, v in verdicts.items() if name != "dmu"), [str(v) for v in found]
    dmu = verdicts["dmu"]
    # at the tightest element: |out - ref| against 2 max|pt - ref| + its floor
    assert dmu.tight_err <= 1.25 * dmu.bound, str(dmu)


def test_fp32_torch_output_of_rows_far_from_every_key_the_property_test_found():
    """Found by the property test in CI (2026-11-27; nothing of the torch path changed that
    day): ALiBi (Laplace, b = 0.5) in fp32 on the torch path, 123 query rows against 2 keys, not
    causal. Row 122's keys sit at log-priors -244 and -242: the torch path's distance table is
    shifted per head, not per row, so its logits there are ~352 in base 2 and float32 rounds
    each (and the table's times log2 e) on a grid of 3e-5, where the reference measures each
    row's prior from its own peak. The output's error grows with the row's distance from the keys (7.6e-7
    in rows 0-9, 2.3e-5 in rows 60-122; the Triton path's ramp, measured from each row's nearest
    key, 3e-7 throughout): 2.324e-5 where the bound allows 2.284e-5 (1.02x) on that day's CI
    machine. Pinned by its ratio, as the case above (docs/reliability.md, "Rows far from every
    key on the torch path"): every other result within its bound, the output within 1.25x of
    its own; the Triton path within its bound."""
    case = dict(prior="laplace", dtype="fp32", B=1, Hq=4, Hk=1, Nq=123, Nk=2, D=16, causal=False,
                q_offset=0, k_offset=0, params={"b": [0.5] * 4}, param_form={"b": "tensor"}, seed=0)
    found = run_case(Case(backend="torch", **case),
                     check=lambda results, dtype, context: [verdict(*r[:4], dtype, *r[4:]) for r in results])
    verdicts = {v.name: v for v in found}
    assert all(v.ok for name, v in verdicts.items() if name != "out"), [str(v) for v in found]
    out = verdicts["out"]
    assert out.tight_err <= 1.25 * out.bound, str(out)
    run_case(Case(backend="triton", **case))


def test_bf16_dk_of_a_two_row_case_the_property_test_found():
    """Found by the property test: GGD, bf16, two query rows against 81 keys at head dim 128,
    causal. The Triton dk of key 0 was 2 bf16 ulps from the float64 answer (3.1e-2 at 2.31)
    where the bound allows 3.0e-2, row 1's dS for key 0 (-9.5) 1.1% off: the interpreter's
    float32 -> bfloat16 casts truncated P and dS where a GPU rounds them to nearest
    (docs/reliability.md, "A bf16 case that was the interpreter's"); rounded as a GPU's
    (helpers._lowp), it is within its bound."""
    run_case(Case(prior="generalized_gaussian", backend="triton", dtype="bf16", B=2, Hq=4, Hk=4,
                  Nq=2, Nk=81, D=128, causal=True, q_offset=0, k_offset=0,
                  params={"alpha": [16.0, 4.948937892913818, 1.0, 11.112985610961914],
                          "beta": [2.0, 2.0, 2.0, 2.0],
                          "mu": [9.776874542236328, -2.0, 3.0, 1.100000023841858]},
                  param_form={"alpha": "tensor", "beta": "float", "mu": "tensor"}, scale=None,
                  seed=1524))
