"""The distance table built on the device (bamgen/runtime/triton/table.py, launch.distance_table)
against the host's torch build (tables.prior_tables) that it replaces on the Triton path for CUDA
tensors: the same entries, from the priors users ship and write, with the parameters, spans and
flags their calls bring. (On CPU tensors the interpreter takes torch's build unless
pinned(table="device"), as here: interpreted, the kernels cost 25-500x that build.)"""
from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import triton
import triton.language as tl

import bamgen
from bamgen.runtime.params import theta as make_theta
from bamgen.runtime.tables import prior_tables
from bamgen.runtime.triton import launch
from bamgen.runtime.triton.helpers import _pow64
from tests.helpers import write_prior
from tests.tolerance import atol_for

TABLE_PRIORS = ["generalized_gaussian", "t5", "t5_bidirectional", "bam", "bam_ssmax", "cauchy",
                "gaussian", "kerple_log", "kerple_power"]
# (bottom, top, causal, with_grads, shifted): a training step's causal square, a bidirectional
# call, a generation step's one row against its keys (bottom > 0), the block API's unshifted
# build, a call without a backward
CALLS = [(-40, 40, True, True, True), (-300, 200, False, True, True), (90, 150, True, True, True),
         (-60, 70, False, True, False), (-5, 5, True, False, True)]
# a long bidirectional call: several programs per head in both passes (launch.TABLE_CHUNK)
LONG = (-2600, 2500, False, True, True)


def _device(prior, theta, *call):
    """The table kernels' table, under the interpreter (pinned: CPU tensors take torch's)."""
    with launch.pinned(table="device"):
        return launch.distance_table(prior, theta, *call)


def _host(prior, theta, *call):
    table, d_top = prior_tables(prior, theta, *call)
    return (launch.base2_log_prior(table) if prior.traits.score_is_s else table), d_top


def _ulps(a, b):
    """Float32 ulps between a and b where both are finite (0 where they are the same value);
    asserts NaN and +-inf at the same entries."""
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    assert torch.equal(torch.isinf(a) & (a > 0), torch.isinf(b) & (b > 0))
    assert torch.equal(torch.isinf(a) & (a < 0), torch.isinf(b) & (b < 0))
    finite = torch.isfinite(a)
    ia, ib = (t.view(torch.int32).long() for t in (a, b))
    ia, ib = (torch.where(i < 0, -(i & 0x7FFFFFFF), i) for i in (ia, ib))   # ordered as floats
    return torch.where(finite & (a != b), (ia - ib).abs(), 0)


def _random_values(module, heads, g):
    """The module's initial values, each element moved by a random factor in [0.5, 2) (keeps a
    positive domain positive, and the exponents off the integers their initial values are)."""
    out = {}
    for name, value in module.default_params(heads).items():
        factor = 2.0 ** (2 * torch.rand(value.shape, generator=g) - 1)
        shift = 3 * torch.randn(value.shape, generator=g) if not value.any() else 0.0   # (mu = 0)
        out[name] = value * factor + shift
    return out


@pytest.mark.parametrize("name", TABLE_PRIORS)
def test_the_device_table_is_the_hosts_for_every_shipped_table_prior(name):
    """Every shipped table prior but Sandwich has the kernel; its table is the torch build's to
    the bit at the initial values (1, 2 and -1 exponents are exact powers), and within one
    float32 ulp at random values (float64's log, exp and powers may round differently between
    libraries; a tie then rounds the other way), for every kind of call."""
    module = importlib.import_module(f"generated.{name}")
    prior = module._prior
    assert "prior_distance" in prior.triton_hooks
    g = torch.Generator().manual_seed(1)
    q = torch.zeros(1, 3, 4, 8)
    for initial, values in ((True, module.default_params(3)), (False, _random_values(module, 3, g))):
        theta = make_theta(prior.traits, q, values, False)
        for call in CALLS + [LONG]:
            device, d_top = _device(prior, theta, *call)
            host, host_top = _host(prior, theta, *call)
            assert d_top == host_top and device.shape == host.shape and device.dtype == host.dtype
            most = int(_ulps(device, host).max())
            assert most <= (0 if initial else 1), (name, initial, call, most)


def test_a_prior_far_from_its_mode_and_a_nan_parameter():
    """GGD with mu = 1e6 (every visible value about -1e6: the shift brings them near 0) and a
    head whose alpha is NaN (the whole head NaN, as the host's table shows it)."""
    module = importlib.import_module("generated.generalized_gaussian")
    prior = module._prior
    values = {"alpha": torch.tensor([3.0, float("nan"), 50.0]), "beta": torch.tensor([1.5, 1.0, 0.7]),
              "mu": torch.tensor([1e6, 0.0, -20.0])}
    theta = make_theta(prior.traits, torch.zeros(1, 3, 4, 8), values, False)
    for call in CALLS:
        device, _ = _device(prior, theta, *call)
        host, _ = _host(prior, theta, *call)
        assert int(_ulps(device, host).max()) <= 1, call
        assert torch.isnan(device[1, 0]).all() and not device[1, 1:].any()   # (P is NaN there)
        if call[4]:   # shifted: not -(1e6 / 3) ** 1.5
            assert device[0, 0].abs().min() < 1e3
    shifted_off = _device(prior, theta, -60, 70, False, True, False)[0]
    assert shifted_off[0, 0].abs().min() > 1e5   # the block API's table keeps the reference


def test_a_users_prior_with_decimal_constants_and_minus_infinity(tmp_path):
    """A user's piecewise prior whose branches are constants float32 cannot hold (0.1, 0.3: in
    Triton a select of two literals alone is float32) and -oo beyond a window: the device table
    holds the float64 values, shifted, then rounded once; -inf where the prior is, and 0 for
    the derivative there; and so does the host's torch build, bit for bit (torch.where takes
    two Python floats as float32: its code selects between float64 tensors, printers.
    TorchFloat64Printer)."""
    path = write_prior(tmp_path, """
        name: stepped
        log_prior: Piecewise((-oo, d > 40), (0.1 * c, d < 8), (0.3 * c - 0.7, True))
        params:
          c: {init: 1.3, domain: positive}
        """)
    module = bamgen.load(path, strategy="table")
    prior = module._prior
    assert prior.traits.table and "prior_distance" in prior.triton_hooks
    c = torch.tensor([1.3, 0.1])
    theta = make_theta(prior.traits, torch.zeros(1, 2, 4, 8), {"c": c}, False)
    for bottom, top, causal, with_grads, shifted in CALLS + [LONG]:
        device, d_top = _device(prior, theta, bottom, top, causal, with_grads, shifted)
        host, _ = _host(prior, theta, bottom, top, causal, with_grads, shifted)
        assert torch.equal(device, host), (bottom, top, causal)
        # by hand, in float64: the shift is the largest value the queries see, first in table
        # order (the largest distance among the ties), and each derivative loses its value there
        d = (d_top - torch.arange(device.shape[2])).double()
        cc = c.double()[:, None]
        value = torch.where(d > 40, -torch.inf, torch.where(d < 8, 0.1 * cc, 0.3 * cc - 0.7))
        tenth, three_tenths = torch.tensor([0.1, 0.3], dtype=torch.float64)   # (not float32)
        grad = torch.where(d > 40, 0.0, torch.where(d < 8, tenth, three_tenths)).expand_as(value)
        lo, hi = (max(bottom, 0), top) if causal else (bottom, top)
        seen = (d >= lo) & (d <= hi)
        if shifted:   # (a head that sees -inf alone keeps its values)
            # argmax over the visible entries alone (all -inf: the first of them, not the row's)
            first = int(seen.nonzero()[0, 0]) if seen.any() else 0
            best = first + value[:, seen].argmax(1, keepdim=True) if seen.any() else \
                torch.zeros(2, 1, dtype=torch.int64)
            shift = value.gather(1, best)
            value = value - torch.where(torch.isinf(shift), 0.0, shift)
            grad = grad - grad.gather(1, best)
        grad = torch.where(value > -torch.inf, grad, 0.0)
        base2 = (value.float().double() * 1.4426950408889634).float()
        assert torch.equal(device[:, 0], base2), (bottom, top, causal)
        if with_grads:
            assert torch.equal(device[:, 1], grad.float()), (bottom, top, causal)
        assert torch.isneginf(device[:, 0, d > 40]).all()


def test_a_prior_the_kernel_cannot_print_keeps_the_hosts_table(tmp_path):
    """A table prior that reads atan (no float64 form in Triton here) has no table kernel: the
    Triton path builds its table with torch, and a call still runs."""
    path = write_prior(tmp_path, """
        name: arctan_prior
        log_prior: -a * atan(Abs(d) / 16) ** 2
        params:
          a: {init: 0.5, domain: positive}
        """)
    module = bamgen.load(path, strategy="table")
    prior = module._prior
    assert prior.traits.table and "prior_distance" not in prior.triton_hooks
    theta = make_theta(prior.traits, torch.zeros(1, 2, 4, 8), {"a": torch.tensor([0.5, 2.0])}, False)
    for call in CALLS:
        assert torch.equal(_device(prior, theta, *call)[0], _host(prior, theta, *call)[0])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 19, 16, generator=g) for _ in range(3))
    out = module.attention(q, k, v, a=torch.tensor([0.5, 2.0]), causal=True, backend="triton")
    ref = module.attention(q, k, v, a=torch.tensor([0.5, 2.0]), causal=True, backend="torch")
    assert (out - ref).abs().max() <= atol_for(torch.float32, ref)


def test_a_pinned_host_build_is_torchs_and_a_bad_pin_is_named():
    """pinned(table="host") (benchmarks/gpu.py's @table=host peers, which time a generation step
    against the table kernels) takes torch's build, no kernel; a pin that is neither "host" nor
    "device" is refused by name."""
    from tests.helpers import ROOT, load_script
    script = load_script(ROOT / "benchmarks" / "launches.py", "launches")
    module = importlib.import_module("generated.generalized_gaussian")
    prior = module._prior
    theta = make_theta(prior.traits, torch.zeros(1, 3, 4, 8), module.default_params(3), False)
    for pin, kernels in (("host", {}), ("device", {"_table_shift_parts": 1, "_distance_table": 1})):
        counter = script.CountedLaunches()
        with script.stubbed_launches(counter), launch.pinned(table=pin):   # (inner pin wins)
            launch.distance_table(prior, theta, -40, 40, True, True, True)
        assert dict(counter.kernels) == kernels, pin
    with launch.pinned(table="host"):
        table, _ = launch.distance_table(prior, theta, *CALLS[0])
    assert torch.equal(table, _host(prior, theta, *CALLS[0])[0])
    with pytest.raises(ValueError, match=r"pinned\(table=...\): 'cpu' is not one of device, host"):
        with launch.pinned(table="cpu"):
            pass


@pytest.mark.parametrize("name", ["generalized_gaussian", "t5"])
def test_a_training_step_on_the_device_table_is_the_hosts(name):
    """A user's training step and a generation step through the Triton kernels reading the
    table kernels' table give the bits they give reading torch's (the tables are equal at the
    initial values): the kernels' layout, strides, base-2 slot and derivative slots are the
    ones the attention kernels read."""
    module = importlib.import_module(f"generated.{name}")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 37, 16, generator=g) for _ in range(3))
    initial = module.default_params(4)   # (T5's are random: drawn once)
    runs = []
    for pin in ("device", "host"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        params = {n: t.clone().requires_grad_() for n, t in initial.items()}
        with launch.pinned(table=pin):
            out = module.attention(*leaves, **params, causal=True, backend="triton")
            grads = torch.autograd.grad(out.square().sum(), leaves + list(params.values()))
            with torch.no_grad():
                step = module.attention(q[:, :, -1:], k, v, **initial, causal=True, q_offset=36,
                                        backend="triton")
        runs.append((out, *grads, step))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_a_users_powers_of_numbers_and_hyperbolics_near_zero(tmp_path):
    """A number to a variable power (2 ** (-|d| / 7): the literal must not reach _pow64 as
    float32) and sinh, tanh at arguments near 0 (1e-12 |d|: their exponential forms cancel to
    four digits there), as a user writes them: the device's table within one float32 ulp of
    torch's."""
    path = write_prior(tmp_path, """
        name: hyperbolic
        log_prior: -c * 1e12 * sinh(Abs(d) * 1e-12) + 2 ** (-Abs(d) / 7) + 1e12 * tanh(d * 1e-12) - cosh(d / 50)
        params:
          c: {init: 0.05, domain: positive}
        """)
    module = bamgen.load(path, strategy="table")
    prior = module._prior
    assert "prior_distance" in prior.triton_hooks
    hook = inspect.getsource(module.prior_distance)
    assert "_sinh64(" in hook and "_tanh64(" in hook and "_cosh64(" in hook
    assert "_pow64(tl.full([], 2.0, tl.float64)" in hook
    theta = make_theta(prior.traits, torch.zeros(1, 2, 4, 8), {"c": torch.tensor([0.05, 0.3])}, False)
    for call in CALLS + [LONG]:
        device, _ = _device(prior, theta, *call)
        host, _ = _host(prior, theta, *call)
        assert int(_ulps(device, host).max()) <= 1, call


@triton.jit
def _powers(B, E, O, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(O + i, _pow64(tl.load(B + i), tl.load(E + i)))


def test_pow64_keeps_pows_special_cases():
    """helpers._pow64, the printed power of the table kernels, against torch.pow over bases and
    exponents that take each special case: x**0 = 1 and 1**y = 1 (NaN too), (+-1)**inf = 1,
    0 to a negative power inf, a negative base's integer powers signed and other powers NaN,
    -inf's non-integer powers those of +inf, -0.0's odd integer powers signed (a table's a * d
    with a < 0 at d = 0); elsewhere within 1e-13 relative (exp(y log x))."""
    inf, nan = float("inf"), float("nan")
    bases = [0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 3.7, -3.7, inf, -inf, nan, 1e-300, 1e300]
    exps = [0.0, 1.0, -1.0, 2.0, -2.0, 3.0, -3.0, 0.5, -0.5, 2.5, inf, -inf, nan, 7.25, -40.0]
    b, e = (t.reshape(-1).contiguous() for t in torch.meshgrid(
        torch.tensor(bases, dtype=torch.float64), torch.tensor(exps, dtype=torch.float64), indexing="ij"))
    n = 1 << (b.numel() - 1).bit_length()
    b, e = (torch.nn.functional.pad(t, (0, n - t.numel()), value=1.0) for t in (b, e))
    out = torch.empty_like(b)
    _powers[(1,)](b, e, out, N=n)
    want = torch.pow(b, e)
    same = ((out == want) & (torch.signbit(out) == torch.signbit(want))) | (torch.isnan(out) & torch.isnan(want))
    close = torch.isfinite(want) & ((out - want).abs() <= 1e-13 * want.abs())
    bad = ~(same | close)
    assert not bad.any(), list(zip(b[bad].tolist(), e[bad].tolist(), out[bad].tolist(), want[bad].tolist()))
