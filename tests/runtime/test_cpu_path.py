"""The CPU (torch) path beyond the property tests.

Both variants of the generated torch path are checked against the float64 reference of
tests/reference.py with the FlashAttention-style bound of tests/tolerance.py:

* the distance-table path (a prior whose logit is s + f(d): laplace, generalized_gaussian), whose
  forward runs torch's fused CPU flash kernel on a strided view of a per-distance table and whose
  backward reduces dS per distance;
* the generic path (priors that read i, j or n, or whose score is not s + log_prior, and any prior
  when forced), the prior evaluated per score.

Shapes cross the block sizes (the module's block constants are shrunk so that small problems have
many ragged blocks; one case runs the default blocks on a longer sequence), with GQA/MQA,
position offsets, rows that see no key, non-causal attention, batch > 1, low-precision inputs and
one or two worker threads. The last test runs ``benchmarks/cpu.py --quick``.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import dataclasses

import bamgen
from bamgen.runtime.cpu import common as cpu_common
from generated import generalized_gaussian as ggd
from generated import laplace
from tests.helpers import ROOT, write_prior
from tests.reference import reference_attention
from tests.tolerance import assert_all_close

GGD_PRIOR = lambda d, p: -(torch.abs(d - p["mu"]) / p["alpha"]) ** p["beta"]
GGD_KINK = lambda d, p: (d - p["mu"]) == 0
LAPLACE_PRIOR = lambda d, p: -torch.abs(d) / p["b"]

# priors built at test time (not distance-only, or not s + log_prior)
EXTRA = {
    "drift_cpu": """
        name: drift_cpu
        log_prior: -Abs(d) / b - i / 10000
        params:
          b: {init: 4.0, domain: positive}
        """,
    "ssmax_cpu": """
        name: ssmax_cpu
        log_prior: -Abs(d) / b
        score: (s + log_prior) * tau * log(n)
        params:
          b: {init: 4.0, domain: positive}
          tau: {init: 0.5, domain: positive}
        """,
    "scaled_cpu": """
        name: scaled_cpu
        log_prior: -Abs(d) / b
        score: (s + log_prior) * tau
        params:
          b: {init: 4.0, domain: positive}
          tau: {init: 0.5, domain: positive}
        """,
}


@pytest.fixture(scope="module")
def extra(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cpu_priors")
    return {name: bamgen.load(write_prior(folder, text, f"{name}.yaml"), cache_dir=folder / "cache")
            for name, text in EXTRA.items()}


@pytest.fixture
def small_blocks(monkeypatch):
    """Shrink every block so that a problem of a few dozen tokens crosses many ragged blocks, and
    run it on worker threads (small problems otherwise run inline in the caller's thread)."""
    def apply(*modules):   # (the CPU path's blocks are the runtime's, the same for every prior)
        monkeypatch.setattr(cpu_common, "TORCH_INLINE_SCORES", 0)
        monkeypatch.setattr(cpu_common, "TORCH_BLOCK_M", 16)
        monkeypatch.setattr(cpu_common, "TORCH_BLOCK_N", 24)
        monkeypatch.setattr(cpu_common, "TORCH_TABLE_FWD_BLOCK", 24)
        monkeypatch.setattr(cpu_common, "TORCH_TABLE_BLOCK_M", 16)
        monkeypatch.setattr(cpu_common, "TORCH_TABLE_BLOCK_N", 40)
    return apply


def force_path(monkeypatch, module, table):
    """Run a prior in d alone on the CPU path's distance-table path (table) or its generic path."""
    traits = module._prior.traits
    monkeypatch.setattr(module._prior, "traits", dataclasses.replace(traits, distance_only=table))


@pytest.fixture
def threads():
    """Run a test body with a given torch thread count, restoring it afterwards."""
    saved = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(saved)


def check(module, log_prior, params, *, B=1, Hq=2, Hk=2, Nq=37, Nk=37, D=16, causal=True,
          q_offset=0, k_offset=0, dtype=torch.float32, kink=None, score=None, seed=0):
    """Run module.attention on the torch backend and check out, dq, dk, dv and every parameter
    gradient against the reference. Returns (out, grads)."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=g).to(dtype)
    q, k, v = draw(B, Hq, Nq, D), draw(B, Hk, Nk, D), draw(B, Hk, Nk, D)
    dout = draw(B, Hq, Nq, D)
    values = {n: torch.tensor(vals, dtype=torch.float32) for n, vals in params.items()}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    p_leaves = {n: t.clone().requires_grad_() for n, t in values.items()}
    kw = dict(causal=causal, q_offset=q_offset, k_offset=k_offset)
    out = module.attention(*leaves, **p_leaves, **kw, backend="torch")
    assert out.dtype == dtype and out.shape == q.shape
    grads = torch.autograd.grad(out, leaves + list(p_leaves.values()), dout)
    rkw = dict(kw, score=score, kink=kink, dout=dout)
    ref = reference_attention(q, k, v, values, log_prior, **rkw)
    pt = reference_attention(q, k, v, values, log_prior, compute_dtype=dtype, **rkw)
    ctx = (f"{module.PRIOR['name']} B={B} Hq={Hq} Hk={Hk} Nq={Nq} Nk={Nk} causal={causal} "
           f"offsets={q_offset},{k_offset} {dtype}")
    names = ["out", "dq", "dk", "dv"] + [f"d{n}" for n in values]
    got = [out.detach(), *grads]
    for name, t in zip(names, got):
        assert bool(torch.isfinite(t).all()), f"{name} is not finite: {ctx}"
    if bool(ref.empty_rows.any()):
        assert bool((got[0].transpose(1, 2)[ref.empty_rows] == 0).all()), ctx
        assert bool((got[1].transpose(1, 2)[ref.empty_rows] == 0).all()), ctx
    wants = [(ref.out, pt.out), (ref.dq, pt.dq), (ref.dk, pt.dk), (ref.dv, pt.dv)]
    wants += [(ref.dparams[n], pt.dparams[n]) for n in values]
    results = [(name, t, r, p, ref.gross.get(name)) for name, t, (r, p) in zip(names, got, wants)]
    assert_all_close(results, dtype, context=ctx)
    return out.detach(), grads


# shapes that cross the shrunk blocks: (B, Hq, Hk, Nq, Nk, causal, q_offset, k_offset)
SHAPES = {
    "square": (1, 2, 2, 61, 61, True, 0, 0),
    "ragged_gqa": (2, 4, 2, 45, 70, True, 0, 0),
    "mqa_bottom_right": (1, 4, 1, 30, 77, True, 47, 0),
    "empty_rows": (1, 2, 1, 50, 41, True, 0, 13),
    "noncausal_offsets": (2, 2, 1, 33, 58, False, 5, 9),
    "decode": (1, 3, 1, 1, 90, True, 89, 0),
    "one_key": (1, 2, 2, 40, 1, True, 0, 0),
}


def _ggd_params(Hq):
    """beta < 1, = 1 and > 1; mu on integers (d == mu is visible) and off them."""
    return {"alpha": [1.5 + 3 * h for h in range(Hq)],
            "beta": ([0.3, 1.0, 1.7, 2.5] * Hq)[:Hq],
            "mu": ([0.0, 1.0, 2.5, -1.0] * Hq)[:Hq]}


def test_the_table_path_is_chosen_exactly_for_s_plus_f_of_d(extra):
    assert ggd.TRAITS.table_path and laplace.TRAITS.table_path
    assert not extra["drift_cpu"].TRAITS.table_path      # reads i
    assert not extra["ssmax_cpu"].TRAITS.table_path      # reads n, score not s + log_prior
    assert not extra["scaled_cpu"].TRAITS.table_path     # distance-only, but d logit / d s = t


@pytest.mark.parametrize("path", ["table", "table_tiles", "generic"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_ggd_across_blocks(shape, path, small_blocks, monkeypatch):
    """table: the fused kernel forward; table_tiles: the exact forward over the backward's tiles
    (what a row with a large log-sum-exp gets); generic: the prior evaluated per score."""
    small_blocks(ggd)
    force_path(monkeypatch, ggd, path != "generic")
    if path == "table_tiles":
        monkeypatch.setattr(cpu_common, "TORCH_FUSED_MAX_LSE", -1.0)
    B, Hq, Hk, Nq, Nk, causal, qo, ko = SHAPES[shape]
    check(ggd, GGD_PRIOR, _ggd_params(Hq), B=B, Hq=Hq, Hk=Hk, Nq=Nq, Nk=Nk, causal=causal,
          q_offset=qo, k_offset=ko, kink=GGD_KINK)


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("shape", ["ragged_gqa", "empty_rows", "noncausal_offsets"])
def test_laplace_across_blocks_and_threads(shape, n_threads, small_blocks, threads):
    """One thread runs every item in one worker; two split heads (disjoint items) or, with fewer
    KV heads than threads, query blocks (items that share a head, summed in item order)."""
    small_blocks(laplace)
    threads(n_threads)
    B, Hq, Hk, Nq, Nk, causal, qo, ko = SHAPES[shape]
    check(laplace, LAPLACE_PRIOR, {"b": [2.0 ** (h + 1) for h in range(Hq)]}, B=B, Hq=Hq, Hk=Hk,
          Nq=Nq, Nk=Nk, causal=causal, q_offset=qo, k_offset=ko)
    assert torch.get_num_threads() == n_threads   # the workers' thread settings did not leak


def test_default_blocks_on_a_longer_sequence(monkeypatch):
    """N larger than the default blocks (512-row kernel calls, 256 x 512 backward tiles, 128 x 512
    generic tiles), ragged, with the kink d == mu and beta < 1 on the diagonal."""
    params = {"alpha": [2.0, 40.0], "beta": [0.5, 1.5], "mu": [0.0, 3.0]}
    kw = dict(B=1, Hq=2, Hk=1, Nq=700, Nk=650, D=16, causal=True, q_offset=0, k_offset=0, kink=GGD_KINK)
    out_t, grads_t = check(ggd, GGD_PRIOR, params, **kw)
    force_path(monkeypatch, ggd, False)
    out_g, grads_g = check(ggd, GGD_PRIOR, params, **kw)
    torch.testing.assert_close(out_t, out_g, rtol=1e-4, atol=1e-5)
    for a, b in zip(grads_t, grads_g):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("path", ["table", "generic"])
@pytest.mark.parametrize("causal", [True, False])
def test_rows_far_from_the_prior_mode(path, causal, small_blocks, monkeypatch):
    """Every visible key of most rows sits far from mu (beta = 3): logits ~ -1e5. The fused
    kernel's LSE is then too coarse to rebuild P from (the table path redoes the forward on its
    own tiles), and P must come from the row max and sum, not from a rounded log-sum-exp."""
    small_blocks(ggd)
    force_path(monkeypatch, ggd, path == "table")
    params = {"alpha": [1.0, 0.7, 3.0, 1.3], "beta": [3.0, 3.0, 2.0, 1.5], "mu": [-40.0, 0.0, 70.0, -3.0]}
    check(ggd, GGD_PRIOR, params, B=1, Hq=4, Hk=2, Nq=60, Nk=20, D=32, causal=causal, kink=GGD_KINK)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype, small_blocks):
    """The backward recomputes O in float32 for delta = rowsum(dO * O): with the stored, rounded O
    the error would be of the storage precision, which the bound does not admit."""
    small_blocks(ggd)
    check(ggd, GGD_PRIOR, _ggd_params(4), B=2, Hq=4, Hk=2, Nq=45, Nk=52, causal=True,
          dtype=dtype, kink=GGD_KINK)


def test_without_the_fused_kernel(small_blocks, monkeypatch):
    """An older torch without the CPU flash op: the generic forward feeds the table backward."""
    small_blocks(ggd)
    monkeypatch.setattr(cpu_common, "FLASH_CPU", None)
    check(ggd, GGD_PRIOR, _ggd_params(4), B=1, Hq=4, Hk=2, Nq=50, Nk=41, q_offset=0, k_offset=13,
          kink=GGD_KINK)


@pytest.mark.parametrize("shape", ["ragged_gqa", "empty_rows", "noncausal_offsets", "decode"])
def test_prior_that_reads_i(extra, shape, small_blocks):
    module = extra["drift_cpu"]
    small_blocks(module)
    B, Hq, Hk, Nq, Nk, causal, qo, ko = SHAPES[shape]
    i_abs = lambda d: (torch.arange(Nq, dtype=d.dtype) + qo)[None, :, None]
    log_prior = lambda d, p: -torch.abs(d) / p["b"] - i_abs(d) / 10000
    check(module, log_prior, {"b": [1.5 + h for h in range(Hq)]}, B=B, Hq=Hq, Hk=Hk, Nq=Nq, Nk=Nk,
          causal=causal, q_offset=qo, k_offset=ko)


@pytest.mark.parametrize("name", ["ssmax_cpu", "scaled_cpu"])
@pytest.mark.parametrize("shape", ["ragged_gqa", "mqa_bottom_right", "empty_rows", "noncausal_offsets"])
def test_score_that_is_not_s_plus_log_prior(extra, name, shape, small_blocks):
    module = extra[name]
    small_blocks(module)
    B, Hq, Hk, Nq, Nk, causal, qo, ko = SHAPES[shape]
    if name == "ssmax_cpu":
        score = lambda s, lp, n, p: (s + lp) * p["tau"] * torch.log(n.to(s.dtype))
    else:
        score = lambda s, lp, n, p: (s + lp) * p["tau"]
    params = {"b": [2.0 + h for h in range(Hq)], "tau": [0.4 + 0.2 * h for h in range(Hq)]}
    check(module, LAPLACE_PRIOR, params, B=B, Hq=Hq, Hk=Hk, Nq=Nq, Nk=Nk, causal=causal,
          q_offset=qo, k_offset=ko, score=score)


@pytest.mark.parametrize("inline", [True, False])
def test_inline_and_worker_runs_agree(inline, monkeypatch):
    """Below TORCH_INLINE_SCORES the items run in the caller's thread; the results are the same
    math (workers flush denormals, which moves nothing here)."""
    monkeypatch.setattr(cpu_common, "TORCH_INLINE_SCORES", 1 << 40 if inline else 0)
    check(ggd, GGD_PRIOR, _ggd_params(4), B=2, Hq=4, Hk=2, Nq=45, Nk=52, kink=GGD_KINK)


def test_the_caller_thread_state_is_left_alone(monkeypatch):
    """Workers run with one intra-op thread and denormals flushed; neither leaks to the caller."""
    monkeypatch.setattr(cpu_common, "TORCH_INLINE_SCORES", 0)
    before = torch.get_num_threads()
    tiny = torch.tensor([2.0 ** -140])
    assert (tiny * 1.0).item() != 0, "denormals are already flushed in this process"
    q = torch.randn(1, 2, 40, 16, requires_grad=True)
    ggd.attention(q, torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16),
                  alpha=2.0, beta=1.0, mu=0.0).sum().backward()
    assert torch.get_num_threads() == before
    assert (tiny * 1.0).item() != 0


def test_quick_benchmark_runs():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu.py"), "--quick"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "| 256 | bamgen-ggd |" in res.stdout and "ggd/sdpa fwd+bwd" in res.stdout, res.stdout


def test_quick_decode_benchmark_runs():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu.py"), "--decode", "--quick"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "| 64 |" in res.stdout and "ggd / sdpa" in res.stdout, res.stdout


def test_quick_field_benchmark_runs_and_its_peers_agree():
    """The field's priors against their materialised biases: the peers compute the same
    attention (the last column), so the timings compare like with like."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu.py"), "--field", "--quick"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line.split("|") for line in res.stdout.splitlines() if line.startswith("| 64 |")]
    diffs = {row[2].strip(): float(row[-2]) for row in rows if row[2].strip() != "ggd"}
    assert sorted(diffs) == ["fire", "sandwich", "t5"], res.stdout
    assert max(diffs.values()) < 1e-4, res.stdout


def test_quick_positions_benchmark_runs_and_its_peers_agree():
    """FoX over position tensors against FoX materialised, and GGD over integer positions read
    from the distance table against the same evaluated per score: each pair the same attention
    (the last column)."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu.py"), "--positions", "--quick"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line.split("|") for line in res.stdout.splitlines() if line.startswith("| 64 |")]
    assert len(rows) == 2 and "Integer positions: GGD" in res.stdout, res.stdout
    assert all(float(row[-2]) < 1e-4 for row in rows), res.stdout


@pytest.mark.parametrize("padded", [False, True], ids=["", "key_mask"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_a_nan_input_poisons_the_same_gradients_on_both_paths(where, causal, padded):
    """A NaN in one element of q, k or v: the CPU path's gradients are NaN exactly where the
    Triton kernels' are (GQA, not causal and causal). A NaN in a query row without the causal
    mask leaves that row's l at 0 beside m = NaN, which the CPU backward once read as a row
    that sees no key: its q and dO were zeroed, and the NaN loss came with finite gradients
    (a NaN check on the gradients, as GradScaler's, would have let the step through). With a
    key_mask, the keys it hides get no gradient from such a row (they were 0 * NaN on the CPU
    path: dS^T q, dS 0 there), as in the kernels, which skip them."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 32, 16, generator=g) for h in (4, 2, 2))
    {"q": q, "k": k, "v": v}[where][0, 0, 10, 3] = float("nan")
    params = ggd.default_params(4)
    patterns = {}
    for backend in ("torch", "triton"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        key_mask = (torch.arange(32) < 28)[None] if padded else None
        out = ggd.attention(*leaves, causal=causal, key_mask=key_mask, backend=backend, **params)
        out.backward(torch.ones_like(out))
        patterns[backend] = [out.isnan()] + [t.grad.isnan() for t in leaves]
    assert bool(patterns["torch"][1].any()), "a NaN loss must reach dq"
    for name, mine, kernels in zip(("out", "dq", "dk", "dv"), patterns["torch"], patterns["triton"]):
        assert torch.equal(mine, kernels), (name, int(mine.sum()), int(kernels.sum()))


def _naive_laplace_grads(q, k, v, b):
    """ALiBi as autograd computes it in float64: the gradients a user's reference has."""
    leaves = [t.double().requires_grad_() for t in (q, k, v, b)]
    q, k, v, b = leaves
    n = q.shape[2]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    logits = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 - (i - j).abs() / b[:, None, None]
    out = logits.masked_fill(j > i, -torch.inf).softmax(-1) @ v
    out.backward(torch.ones_like(out))
    return [t.grad for t in leaves]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_infinite_value_poisons_the_gradients_the_reference_poisons(backend):
    """+inf and -inf in v, causal: dk and ALiBi's db are NaN exactly where autograd's float64
    gradients are. The CPU table path once made dk NaN for keys that rows after the inf only
    mask (dS = 0 * -inf where their delta was inf); the kernels' parameter sums clamped the NaN
    to -3.4e38, a finite gradient that a NaN check (GradScaler's) lets through."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=g) for _ in range(3))
    v[0, 0, 3, 2], v[0, 1, 5, 1] = torch.inf, -torch.inf
    b = laplace.default_params(2)["b"]
    leaves = [t.clone().requires_grad_() for t in (q, k, v, b)]
    out = laplace.attention(*leaves[:3], b=leaves[3], causal=True, backend=backend)
    out.backward(torch.ones_like(out))
    expected = _naive_laplace_grads(q, k, v, b)
    for name, mine, ref in zip(("dq", "dk", "dv", "db"), [t.grad for t in leaves], expected):
        assert torch.equal(mine.isnan(), ref.isnan()), (name, int(mine.isnan().sum()), int(ref.isnan().sum()))
    assert bool(leaves[3].grad.isnan().all())
