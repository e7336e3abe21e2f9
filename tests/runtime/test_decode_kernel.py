"""Decode steps on both paths: the split-KV decode kernel (flash-decoding) under the Triton
interpreter, and the CPU path's decode step.

A call with at most DECODE_ROWS (16) query rows and no backward to follow (a generation step)
runs `_attn_decode` over key splits and merges the splits by log-sum-exp in `_decode_combine`.
Under TRITON_INTERPRET=1 a split holds 32 keys, so the ragged lengths below cross many split
and tile borders. Checked here:

* the output against the float64 reference (the tolerance of docs/architecture.md, "Testing") for every tile kind of
  prior, with a KV cache's offsets, per-row offsets and left padding (key_mask), GQA, causal or
  not, bf16 and float32, and rows that see no key;
* the merged row statistics equal the prefill kernel's (m bit for bit, l to rounding);
* a windowed prior skips whole splits: keys only skipped splits hold are NaN and reach nothing;
* which calls take it: at most 16 rows without autograd; a backward or 17 rows take the prefill
  kernel.

The CPU path's decode step (`_torch_decode`: torch's fused kernel with the prior's bias as its
mask, the bias kept across steps) is held to the same reference by the same cases, and:

* a step's output does not depend on the steps before it: a generation of growing caches gives,
  at every step, the bits a fresh process (an empty table cache) gives;
* new parameter values (an optimiser step, another layer) never reuse another set's bias;
* where it does not apply (a NaN in a key some row does not see, a NaN prior) the general path
  answers, with the same result as before.
"""
from __future__ import annotations

import importlib
import math

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import bamgen
from bamgen.runtime import checks
from bamgen.runtime.cpu import decode as cpu_decode
from bamgen.runtime.params import theta as make_theta
from bamgen.runtime.triton import launch
from tests.helpers import write_prior
from tests.reference import reference_attention
from tests.runtime.test_masks import DTYPES, MASK_PRIORS, NO_SHRINK, SCALE, params_for
from tests.runtime.test_runtime_fuzz import PRIORS
from tests.runtime.test_runtime_fuzz import _layout as fuzz_layout
from tests.tolerance import assert_all_close


def load(prior):
    return importlib.import_module(f"generated.{prior}")


class DecodeSpy:
    """Counts the calls that took a decode path: the Triton decode kernels (launch.decode), or
    the CPU path's decode step (cpu.decode.decode, when it answered rather than handing over)."""

    def __init__(self, mod, monkeypatch, backend="triton"):
        self.calls = 0
        owner = launch if backend == "triton" else cpu_decode
        real = owner.decode

        def spy(*args, **kwargs):
            got = real(*args, **kwargs)
            self.calls += backend == "triton" or got is not None
            return got

        monkeypatch.setattr(owner, "decode", spy)


@st.composite
def decode_cases(draw):
    B = draw(st.sampled_from([1, 2, 3]))
    Hq = draw(st.sampled_from([1, 2, 4]))
    Hk = draw(st.sampled_from([h for h in (1, 2, 4) if Hq % h == 0]))
    Nq = draw(st.sampled_from([1, 2, 5, 16]))
    Nk = draw(st.sampled_from([1, 17, 64, 123, 200]))
    offsets = draw(st.sampled_from(["cache", "zero", "per_row", "far"]))
    if offsets == "cache":      # the new rows are the last Nq positions of the sequence
        q_offset, k_offset = Nk - Nq, 0
    elif offsets == "far":      # positions deep into a long generation
        q_offset, k_offset = 5000 + Nk - Nq, 5000
    elif offsets == "zero":
        q_offset, k_offset = 0, 0
    else:                       # a left-padded batch: row b starts pad_b keys late
        pads = [draw(st.integers(0, Nk)) for _ in range(B)]
        q_offset = [Nk - Nq - p for p in pads]
        k_offset = [-p for p in pads]
    key_mask = None
    if offsets == "per_row":
        key_mask = [[0] * p + [1] * (Nk - p) for p in pads]
    elif draw(st.booleans()):
        key_mask = [[draw(st.integers(0, 1)) for _ in range(Nk)] for _ in range(B)]
    return dict(prior=draw(st.sampled_from(MASK_PRIORS)), dtype=draw(st.sampled_from(list(DTYPES))),
                B=B, Hq=Hq, Hk=Hk, Nq=Nq, Nk=Nk, D=draw(st.sampled_from([8, 16, 80])),
                causal=draw(st.booleans()), q_offset=q_offset, k_offset=k_offset, key_mask=key_mask,
                seed=draw(st.integers(0, 2 ** 31 - 1)))


def check_against_prior(out, prior, q, k, v, params, dtype, context, **kw):
    """out against the float64 reference of a shipped prior (tests/tolerance.py's yardstick);
    kw: attention()'s layout arguments. Returns the reference's result."""
    pdef = PRIORS[prior]
    rkw = dict(kw, score=pdef.score, kink=pdef.kink)
    ref = reference_attention(q, k, v, params, pdef.log_prior, **rkw)
    pt = reference_attention(q, k, v, params, pdef.log_prior, compute_dtype=dtype, **rkw)
    assert_all_close([("out", out, ref.out, pt.out)], dtype, context=context)
    return ref


def run_decode_case(c, monkeypatch, backend="triton"):
    mod = load(c["prior"])
    spy = DecodeSpy(mod, monkeypatch, backend)
    dtype = DTYPES[c["dtype"]]
    g = torch.Generator().manual_seed(c["seed"])
    q = torch.randn(c["B"], c["Hq"], c["Nq"], c["D"], generator=g).to(dtype)
    k, v = (torch.randn(c["B"], c["Hk"], c["Nk"], c["D"], generator=g).to(dtype) for _ in range(2))
    params = {n: t.detach() for n, t in params_for(mod, c["Hq"], g).items()}
    kw = dict(causal=c["causal"])
    for name in ("q_offset", "k_offset"):
        kw[name] = torch.tensor(c[name]) if isinstance(c[name], list) else c[name]
    if c["key_mask"] is not None:
        kw["key_mask"] = torch.tensor(c["key_mask"], dtype=torch.bool)
    with torch.no_grad():
        out = mod.attention(q, k, v, **params, backend=backend, **kw)
    # (SSMax has no distance table on the CPU path: its steps take the general path)
    assert spy.calls == (backend == "triton" or mod.TRAITS.table_path), f"the decode path did not run; {c!r}"
    assert bool(torch.isfinite(out).all()), f"out is not finite; {c!r}"
    ref = check_against_prior(out, c["prior"], q, k, v, params, dtype, repr(c), **kw)
    empty = ref.empty_rows
    if bool(empty.any()):
        assert bool((out.transpose(1, 2)[empty] == 0).all()), f"rows that see no key are not 0; {c!r}"


@settings(max_examples=20 * SCALE, deadline=None, print_blob=True,
          phases=NO_SHRINK if SCALE == 1 else list(Phase),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_decode_matches_reference(data, monkeypatch):
    run_decode_case(data.draw(decode_cases(), label="case"), monkeypatch)


@settings(max_examples=40 * SCALE, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_cpu_decode_matches_reference(data, monkeypatch):
    run_decode_case(data.draw(decode_cases(), label="case"), monkeypatch, backend="torch")


@pytest.mark.parametrize("prior, causal", [("laplace", True), ("generalized_gaussian", False),
                                           ("bam_ssmax", True)])
def test_decode_statistics_equal_the_prefill_kernels(prior, causal):
    """The merged (m, l) of every row are the prefill kernel's: m is the same maximum of the same
    logits (bit for bit), l the same sum in another order. The split-KV call and the prefill
    call are made on the same inputs through the module's launcher."""
    mod = load(prior)
    g = torch.Generator().manual_seed(7)
    B, Hq, Hk, Nq, Nk, D = 2, 4, 2, 3, 150, 16
    q = torch.randn(B, Hq, Nq, D, generator=g)
    k, v = (torch.randn(B, Hk, Nk, D, generator=g) for _ in range(2))
    theta = make_theta(mod.TRAITS, q, {n: t for n, t in params_for(mod, Hq, g).items()}, grad=False)
    scale = D ** -0.5
    out_d, stats_d, _, _ = launch.forward(mod._prior, q, k, v, theta, causal, scale, Nk - Nq, 0)
    out_p, stats_p, _, _ = launch.forward(mod._prior, q, k, v, theta, causal, scale, Nk - Nq, 0,
                                          for_backward=True)
    torch.testing.assert_close(out_d, out_p, rtol=2e-6, atol=2e-6)
    assert torch.equal(stats_d[0], stats_p[0])
    torch.testing.assert_close(stats_d[1], stats_p[1], rtol=2e-6, atol=0)


WINDOW = """
name: local_window
description: ALiBi inside a window of w keys back, nothing beyond (a sliding window)
log_prior: Piecewise((-Abs(d) / b, Abs(d) <= w), (-oo, True))
params:
  b: {init: 4.0, domain: positive}
  w: {value: 5}
"""


def test_window_prior_skips_whole_splits(tmp_path, monkeypatch):
    """One query at position 199 sees keys 194..199 only: every split but the last holds keys
    no row can see. Those keys are NaN; a split that visited them would poison the merge."""
    module = bamgen.load(write_prior(tmp_path, WINDOW), cache_dir=tmp_path / "cache")
    spy = DecodeSpy(module, monkeypatch)
    torch.manual_seed(0)
    B, H, Nk, D = 2, 2, 200, 16
    q = torch.randn(B, H, 1, D)
    k, v = torch.randn(B, H, Nk, D), torch.randn(B, H, Nk, D)
    k_used, v_used = k.clone(), v.clone()
    k_used[:, :, :160] = float("nan")
    v_used[:, :, :160] = float("nan")
    b = torch.tensor([2.0, 7.0])
    with torch.no_grad():
        out = module.attention(q, k_used, v_used, b=b, q_offset=Nk - 1, backend="triton")
    assert spy.calls == 1
    window = lambda d, p: torch.where(d.abs() <= 5, -d.abs() / p["b"], -torch.inf)  # noqa: E731
    ref = reference_attention(q, k, v, {"b": b}, window, causal=True, q_offset=Nk - 1)
    pt = reference_attention(q, k, v, {"b": b}, window, causal=True, q_offset=Nk - 1,
                             compute_dtype=torch.float32)
    assert_all_close([("out", out, ref.out, pt.out)], torch.float32, context="window decode")


def test_which_calls_take_the_decode_kernel(monkeypatch):
    mod = load("generalized_gaussian")
    spy = DecodeSpy(mod, monkeypatch)
    params = mod.default_params(2)
    k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    with torch.no_grad():
        mod.attention(torch.randn(1, 2, 16, 16), k, v, **params, q_offset=24, backend="triton")
    assert spy.calls == 1                                   # 16 rows, no autograd: decode
    with torch.no_grad():
        mod.attention(torch.randn(1, 2, 17, 16), k, v, **params, q_offset=23, backend="triton")
    assert spy.calls == 1                                   # 17 rows: the prefill kernel
    q = torch.randn(1, 2, 1, 16, requires_grad=True)
    mod.attention(q, k, v, **params, q_offset=39, backend="triton").sum().backward()
    assert spy.calls == 1 and q.grad is not None            # a backward follows: prefill
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 40], dtype=torch.int32)
    with torch.no_grad():
        mod.attention(torch.randn(1, 2, 2, 16), k, v, **params, cu_seqlens_q=cu, cu_seqlens_k=cu_k,
                      backend="triton")
    assert spy.calls == 1                                   # packed documents: prefill


# --------------------------------------------------------------------------------------------
# the CPU path's decode step: its kept bias, and where it hands over


def _jittered(mod, H, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: t.detach() for n, t in params_for(mod, H, g).items()}


@pytest.mark.parametrize("prior", ["generalized_gaussian", "laplace", "uniform"])
def test_cpu_decode_step_does_not_depend_on_the_steps_before(prior, monkeypatch):
    """A generation of growing caches, with tables of 16 distances per chunk so that the steps
    cross many chunk borders: every step's output has the bits that step gives from an empty
    table cache (a fresh process), with left padding (per-row offsets) and GQA, and after a
    jump backwards (a new prompt: the kept span does not extend)."""
    mod = load(prior)
    monkeypatch.setattr(cpu_decode, "TORCH_DECODE_CHUNK", 64)    # 4 heads x 16 distances
    g = torch.Generator().manual_seed(1)
    B, Hq, Hk, D, total = 2, 4, 2, 16, 150
    q = torch.randn(B, Hq, total, D, generator=g)
    k, v = (torch.randn(B, Hk, total, D, generator=g) for _ in range(2))
    params = _jittered(mod, Hq, 2)
    pads = torch.tensor([0, 9])
    key_mask = torch.arange(total)[None] >= pads[:, None]
    lengths = list(range(1, total + 1, 7)) + [40, 41, 3]

    def step(n):
        return mod.attention(q[:, :, n - 1:n], k[:, :, :n], v[:, :, :n], **params, q_offset=n - 1 - pads,
                             k_offset=-pads, key_mask=key_mask[:, :n], backend="torch")

    spy = DecodeSpy(mod, monkeypatch, "torch")
    with torch.no_grad():
        history = [step(n) for n in lengths]
        for n, got in zip(lengths, history):
            mod._prior.decode_tables.tables.clear()
            assert torch.equal(step(n), got), n
    assert spy.calls == 2 * len(lengths)


def test_cpu_decode_new_parameters_never_reuse_a_bias(monkeypatch):
    """Two layers' parameter sets alternate, then one changes in place (an optimiser step): each
    call equals the same call from an empty table cache, and the two sets' outputs differ."""
    mod = load("generalized_gaussian")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 1, 16, generator=g)
    k, v = (torch.randn(1, 4, 90, 16, generator=g) for _ in range(2))
    layer_a, layer_b = _jittered(mod, 4, 4), _jittered(mod, 4, 5)

    def call(params):
        return mod.attention(q, k, v, **params, q_offset=89, backend="torch")

    before = {n: t.clone() for n, t in layer_a.items()}
    with torch.no_grad():
        outs = [call(layer_a), call(layer_b), call(layer_a)]
        layer_a["alpha"].mul_(1.5)            # in place: the same tensor, new values
        outs.append(call(layer_a))
        fresh = []
        for params in (before, layer_b, before, layer_a):
            mod._prior.decode_tables.tables.clear()
            fresh.append(call({n: t.clone() for n, t in params.items()}))
    for got, want in zip(outs, fresh):
        assert torch.equal(got, want)
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[3])


def test_cpu_decode_hands_a_hidden_nan_to_the_general_path(monkeypatch):
    """Speculative decoding's staircase: 3 new rows, the last key seen by the last row only. A
    NaN stored in that key reaches that row alone (as SDPA's math has it); the decode step,
    whose mask would add -inf to the NaN score, hands the call to the general path."""
    mod = load("generalized_gaussian")
    spy = DecodeSpy(mod, monkeypatch, "torch")
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 2, 3, 16, generator=g)
    k, v = (torch.randn(1, 2, 30, 16, generator=g) for _ in range(2))
    k[:, :, -1] = float("nan")
    params = mod.default_params(2)
    with torch.no_grad():
        out = mod.attention(q, k, v, **params, q_offset=27, backend="torch")
    assert spy.calls == 0
    assert bool(torch.isfinite(out[:, :, :2]).all()) and bool(torch.isnan(out[:, :, 2]).all())
    with torch.no_grad():                     # one row: every key visible, the step itself
        one = mod.attention(q[:, :, 2:], k, v, **params, q_offset=29, backend="torch")
    assert spy.calls == 1 and bool(torch.isnan(one).all())


def test_cpu_decode_row_outside_a_window_is_zero(tmp_path, monkeypatch):
    """A query whose window of distances holds no key sees nothing: output 0 and statistics
    (-inf, 0), as on the general path; a query in reach of its window is the reference's."""
    module = bamgen.load(write_prior(tmp_path, WINDOW), cache_dir=tmp_path / "cache")
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 2, 1, 16, generator=g)
    k, v = (torch.randn(1, 2, 20, 16, generator=g) for _ in range(2))
    b = torch.tensor([2.0, 7.0])
    layout = checks.layout(q, k, 40, 0, None, None, None)
    theta = make_theta(module.TRAITS, q, {"b": b}, grad=False)
    out, stats = cpu_decode.decode(module._prior, q, k, v, theta, True, 0.25, layout)
    assert bool((out == 0).all()) and bool((stats[..., 0] == -math.inf).all()) and bool((stats[..., 1] == 0).all())
    spy = DecodeSpy(module, monkeypatch, "torch")
    with torch.no_grad():
        near = module.attention(q, k, v, b=b, q_offset=22, backend="torch")
    assert spy.calls == 1
    window = lambda d, p: torch.where(d.abs() <= 5, -d.abs() / p["b"], -torch.inf)  # noqa: E731
    ref = reference_attention(q, k, v, {"b": b}, window, causal=True, q_offset=22)
    pt = reference_attention(q, k, v, {"b": b}, window, causal=True, q_offset=22, compute_dtype=torch.float32)
    assert_all_close([("out", near, ref.out, pt.out)], torch.float32, context="window cpu decode")


def test_module_decode_under_no_grad_takes_the_step(monkeypatch):
    """The nn.Module in a generation loop (eval, no_grad) takes the decode step; with autograd
    on, the general path (its backward needs the exact statistics)."""
    mod = load("generalized_gaussian")
    spy = DecodeSpy(mod, monkeypatch, "torch")
    layer = getattr(mod, mod.PRIOR["class_name"])(num_heads=4)
    q = torch.randn(1, 4, 1, 16)
    k, v = torch.randn(1, 2, 50, 16), torch.randn(1, 2, 50, 16)
    with torch.no_grad():
        a = layer(q, k, v, q_offset=49, backend="torch")
    assert spy.calls == 1
    b = layer(q, k, v, q_offset=49, backend="torch")
    assert spy.calls == 1 and b.requires_grad
    torch.testing.assert_close(a, b.detach(), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("padding", ["finite", "nan", "inf", "huge"])
def test_cpu_decode_reads_a_static_cache_as_it_is(padding, monkeypatch):
    """A static cache as Hugging Face keeps it: K and V are slices of a larger buffer (not
    contiguous), a left-padded batch's padding slots hold whatever the buffer held (NaN, inf or
    1e38 in uninitialised memory) and key_mask hides them. The step reads the slices without
    copying them and gives the reference's rows, computed on the same keys with the padding set
    to 0; padding that is not finite, or so large that q.k overflows, is read as 0 rather than
    reaching every row as 0 * NaN or inf - inf."""
    mod = load("generalized_gaussian")
    spy = DecodeSpy(mod, monkeypatch, "torch")
    g = torch.Generator().manual_seed(11)
    B, Hq, Hk, D, Nk, pads = 3, 4, 2, 16, 37, [0, 5, 12]
    # huge: finite, but q.k overflows to inf there, and inf + -inf is NaN
    fill = {"finite": 0.5, "nan": float("nan"), "inf": float("inf"), "huge": 1e38}[padding]
    k_buf, v_buf = (torch.full((B, Hk, 64, D), float("nan")) for _ in range(2))
    k_buf[:, :, :Nk], v_buf[:, :, :Nk] = (torch.randn(B, Hk, Nk, D, generator=g) for _ in range(2))
    key_mask = torch.ones(B, Nk, dtype=torch.bool)
    for b, p in enumerate(pads):
        k_buf[b, :, :p], v_buf[b, :, :p], key_mask[b, :p] = fill, fill, False
    k, v = k_buf[:, :, :Nk], v_buf[:, :, :Nk]
    before = (k.clone(), v.clone())
    q = torch.randn(B, Hq, 1, D, generator=g)
    params = {n: t.detach() for n, t in params_for(mod, Hq, g).items()}
    kw = dict(q_offset=torch.tensor([Nk - 1 - p for p in pads]), k_offset=torch.tensor([-p for p in pads]),
              key_mask=key_mask)
    with torch.no_grad():
        out = mod.attention(q, k, v, **params, backend="torch", **kw)
    assert spy.calls == 1 and bool(torch.isfinite(out).all())
    assert torch.equal(k.nan_to_num(), before[0].nan_to_num()) and torch.equal(v.nan_to_num(), before[1].nan_to_num())
    hidden = ~key_mask[:, None, :, None]
    k0, v0 = k.masked_fill(hidden, 0.0), v.masked_fill(hidden, 0.0)
    check_against_prior(out, "generalized_gaussian", q, k0, v0, params, torch.float32,
                        f"static cache, {padding} padding", causal=True, **kw)


@pytest.mark.parametrize("layout", ["transposed", "strided_slice", "bnhd", "expanded"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cpu_decode_takes_the_layouts_users_bring(layout, dtype, monkeypatch):
    """q, k and v in the memory layouts real code hands over (the runtime fuzz's): a head dim
    that is not unit-stride (a transposed or strided view), [B, N, H, D] storage, a broadcast
    batch. The fused kernel reads every stride but the head dim's, so the step gives the
    reference's rows for all of them (a transposed K once gave garbage here)."""
    mod = load("generalized_gaussian")
    spy = DecodeSpy(mod, monkeypatch, "torch")
    g = torch.Generator().manual_seed(12)
    B, Hq, Hk, Nq, Nk, D = 2, 4, 2, 3, 40, 16
    q = torch.randn(B, Hq, Nq, D, generator=g).to(DTYPES[dtype])
    k, v = (torch.randn(1, Hk, Nk, D, generator=g).expand(B, Hk, Nk, D).contiguous().to(DTYPES[dtype])
            for _ in range(2))
    qx, kx, vx = (fuzz_layout(t, layout) for t in (q, k, v))
    params = {n: t.detach() for n, t in params_for(mod, Hq, g).items()}
    with torch.no_grad():
        out = mod.attention(qx, kx, vx, **params, q_offset=Nk - Nq, backend="torch")
    assert spy.calls == 1
    check_against_prior(out, "generalized_gaussian", q, k, v, params, DTYPES[dtype],
                        f"{layout} {dtype}", causal=True, q_offset=Nk - Nq)
