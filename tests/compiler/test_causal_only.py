"""A prior written for causal attention (`causal_only: true`, docs/priors.md "Causal-only
priors"): checked at d >= 0 alone, it builds, runs causal on both paths as the float64
reference does, and every call that could put a key after its query is refused, naming the
field and the causal= argument."""
from __future__ import annotations

import pytest
import torch

import bamgen
from tests.helpers import run_cli, write_prior
from tests.reference import reference_attention
from tests.tolerance import assert_all_close

# KERPLE-log's -r1*log(1 + r2*|d|) (Chi et al., 2205.09921) as a causal model writes it: d >= 0
CAUSAL_LOG = """
name: causal_log
log_prior: -a*log(1 + d)
params:
  a: {init: 1.0, domain: positive}
causal_only: true
"""


def _log_prior(d, p):
    """The reference's log-prior; at the keys the causal mask hides (d < 0) any finite value."""
    return -p["a"] * torch.log1p(d.clamp(min=0))


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("causal")
    return bamgen.load(write_prior(folder, CAUSAL_LOG), cache_dir=folder / "cache")


def _inputs(B=1, Nq=7, Nk=19, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, 2, n, 16, generator=g) for n in (Nq, Nk, Nk))
    return q, k, v, torch.randn(B, 2, Nq, 16, generator=g)


# --------------------------------------------------------------------------------------------
# the build

def test_without_the_declaration_the_scan_names_it(tmp_path):
    text = CAUSAL_LOG.replace("causal_only: true\n", "")
    res = run_cli("build", str(write_prior(tmp_path, text)), "-o", str(tmp_path / "out"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert "the log-prior is nan at d = -" in lines[0] and "causal_only: true" in lines[0]
    assert not (tmp_path / "out").exists()


def test_the_hint_is_given_only_where_keys_after_the_query_fail(tmp_path):
    text = "log_prior: sqrt(c - 1) - Abs(d)\nparams:\n  c: {init: 2.0, domain: positive}\n"
    res = run_cli("build", str(write_prior(tmp_path, text)), "-o", str(tmp_path / "out"))
    assert res.returncode == 2 and "the log-prior is nan" in res.stderr, res.stderr
    assert "causal_only" not in res.stderr   # nan at c = 0.01 for every d: no causal matter


def test_the_declared_prior_builds_and_show_states_it(tmp_path):
    prior = write_prior(tmp_path, CAUSAL_LOG)
    built = run_cli("build", str(prior), "-o", str(tmp_path / "out"))
    assert built.returncode == 0, built.stderr
    text = (tmp_path / "out" / "causal_log.py").read_text()
    assert "causal_only=True" in text and "'causal_only': True" in text
    shown = run_cli("show", str(prior))
    assert shown.returncode == 0, shown.stderr
    assert "causal only (causal_only: true): checked at d = i - j >= 0 alone" in shown.stdout
    assert "causal only: yes (analysed at d >= 0)" in shown.stdout
    assert "symmetric in d" not in shown.stdout


def test_a_kink_before_the_query_is_no_singularity(tmp_path):
    """|d + 1| is 0 at d = -1 only, where a causal-only prior is never read: no guard, no note."""
    text = "name: kinky\nlog_prior: -Abs(d + 1)**b\nparams:\n  b: {init: 1.0, domain: positive}\n"
    for causal_only, guarded in (False, True), (True, False):
        body = text + ("causal_only: true\n" if causal_only else "")
        res = run_cli("build", str(write_prior(tmp_path, body)), "-o", str(tmp_path / "out"))
        assert res.returncode == 0, res.stderr
        assert ("at d + 1 = 0" in res.stdout) == guarded, res.stdout


@pytest.mark.parametrize("text, words", [
    # still checked where keys are at or before the query
    ("log_prior: log(50 - d)", "the log-prior is nan at d = 51"),
    # beyond the dense scan: d is read as Abs(d), and the poles' search looks through it
    ("log_prior: -a*d + 1/(d - 5000)", "the log-prior is +inf at d = 5000"),
    ("log_prior: -a*sqrt((d - 100000)*(d - 100002))", "the log-prior is nan at d = 100001"),
    ("log_prior: -a*log(1 + d)\ncausal_only: \"yes\"", "field 'causal_only': expected true or false"),
    ("log_prior: -a*log(1 + d0) - d1\npositions: 2",
     "field 'causal_only': a prior over 2 position channels cannot be causal only"),
])
def test_refusals_leave_earlier_outputs_untouched(tmp_path, text, words):
    out = tmp_path / "out"
    good = write_prior(tmp_path, CAUSAL_LOG.replace("causal_log", "bad"), "good.yaml")
    assert run_cli("build", str(good), "-o", str(out)).returncode == 0
    before = (out / "bad.py").read_bytes()
    body = f"name: bad\n{text}\nparams:\n  a: {{init: 1.0, domain: positive}}\n"
    if "causal_only" not in text:
        body += "causal_only: true\n"
    res = run_cli("build", str(write_prior(tmp_path, body, "bad.yaml")), "-o", str(out))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and "bad.yaml" in lines[0] and words in lines[0], res.stderr
    assert (out / "bad.py").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["bad.py"]


# --------------------------------------------------------------------------------------------
# causal calls: the float64 reference (docs/architecture.md, "Testing")

@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("shape", [dict(Nq=7, Nk=19, q_offset=12),          # chunked prefill
                                   dict(Nq=1, Nk=40, q_offset=20),          # decode, keys after it cached
                                   dict(B=2, Nq=5, Nk=9, q_offset=torch.tensor([4, 1]),
                                        k_offset=torch.tensor([0, -3])),   # per-row offsets
                                   dict(Nq=12, Nk=12, cu_seqlens_q=torch.tensor([0, 5, 12]),
                                        cu_seqlens_k=torch.tensor([0, 5, 12]))])   # documents
def test_causal_calls_match_the_reference(module, backend, shape):
    shape = dict(shape)
    q, k, v, dout = _inputs(shape.pop("B", 1), shape.pop("Nq"), shape.pop("Nk"))
    params = {"a": torch.tensor([0.7, 1.5])}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    a = params["a"].clone().requires_grad_()
    out = module.attention(*leaves, a=a, causal=True, backend=backend, **shape)
    grads = torch.autograd.grad(out, leaves + [a], dout)
    kw = dict(causal=True, dout=dout, **shape)
    ref = reference_attention(q, k, v, params, _log_prior, **kw)
    pt = reference_attention(q, k, v, params, _log_prior, compute_dtype=torch.float32, **kw)
    results = [("out", out, ref.out, pt.out), ("dq", grads[0], ref.dq, pt.dq),
               ("dk", grads[1], ref.dk, pt.dk), ("dv", grads[2], ref.dv, pt.dv),
               ("da", grads[3], ref.dparams["a"], pt.dparams["a"])]
    assert all(torch.isfinite(r).all() for _, r, _, _ in results)
    assert_all_close(results, torch.float32, context=f"{backend} {shape}")


# --------------------------------------------------------------------------------------------
# every call that could put a key after its query

def _refused(call, *words):
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "causal_only: true" in message and "'causal_log'" in message, message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_non_causal_calls_are_refused(module, backend):
    q, k, v, dout = _inputs()
    a = torch.tensor([0.7, 1.5])
    _refused(lambda: module.attention(q, k, v, a=a, causal=False, backend=backend),
             "causal=False", "causal=True")
    layer = module.CausalLogAttention(num_heads=2)
    _refused(lambda: layer(q, k, v, causal=False, backend=backend), "causal=False")
    _refused(lambda: module.forward_block(q, k, v, a=a, causal=False, backend=backend),
             "causal=False")
    out, stats = module.forward_block(q, k, v, a=a, causal=True, q_offset=12, backend=backend)
    _refused(lambda: module.backward_block(dout, q, k, v, out, stats, a=a, causal=False,
                                           q_offset=12, backend=backend), "causal=False")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compiled_calls_are_refused_with_the_eager_error(module, backend):
    """Under torch.compile(fullgraph=True) the refusal is the eager ValueError, raised when the
    ops run (raised while dynamo traced, it surfaced as dynamo's Unsupported)."""
    q, k, v, _ = _inputs(Nk=7)
    a = torch.tensor([0.7, 1.5])
    pos = torch.arange(7.0)[None]
    layer = module.CausalLogAttention(num_heads=2)
    calls = [lambda q: module.attention(q, k, v, a=a, causal=False, backend=backend),
             lambda q: module.attention(q, k, v, a=a, pos_q=pos, pos_k=pos, backend=backend),
             lambda q: layer(q, k, v, causal=False, backend=backend)]
    for call in calls:
        with pytest.raises(ValueError) as eager:
            call(q)
        compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
        _refused(lambda: compiled(q))
        with pytest.raises(ValueError) as traced:
            compiled(q)
        assert str(traced.value) == str(eager.value)


def test_positions_as_tensors_are_refused(module):
    q, k, v, _ = _inputs(Nk=7)
    pos = torch.arange(7.0)[None]
    _refused(lambda: module.attention(q, k, v, a=1.0, pos_q=pos, pos_k=pos), "pos_q, pos_k",
             "token positions")
    _refused(lambda: module.CausalLogAttention(num_heads=2)(q, k, v, pos_q=pos, pos_k=pos),
             "pos_q, pos_k")


def test_negative_distances_and_the_ring_are_refused(module):
    _refused(lambda: module.log_prior_at([-1, 0, 1], a=1.0), "d holds -1")
    assert torch.isfinite(module.log_prior_at([0, 1, 4096], a=1.0)).all()
    from bamgen.distributed import ring_attention
    q, k, v, _ = _inputs(Nq=8, Nk=8)
    _refused(lambda: ring_attention(module, q, k, v, causal=False, a=torch.tensor([1.0, 1.0])),
             "causal=False")


# --------------------------------------------------------------------------------------------
# d = 0, the diagonal: a kink as |d|'s is

KERPLE_POWER = """
name: causal_power
log_prior: -r1*d**r2
params:
  r1: {init: 1.0, domain: positive}
  r2: {init: 0.7, domain: positive}
causal_only: true
"""


def test_a_log_of_d_is_clamped_at_the_diagonal_as_a_log_of_abs_d_is(tmp_path):
    """-a*log(d) at d = 0 has no finite limit: clamped to 1e-5 with a note, as -a*log(Abs(d))
    is without the declaration (docs/priors.md, "Kinks")."""
    notes = []
    for text in ("log_prior: -a*log(d)\ncausal_only: true\n", "log_prior: -a*log(Abs(d))\n"):
        body = f"name: logd\n{text}params:\n  a: {{init: 1.0, domain: positive}}\n"
        res = run_cli("build", str(write_prior(tmp_path, body)), "-o", str(tmp_path / "out"))
        assert res.returncode == 0, res.stderr
        notes.append([line for line in res.stdout.splitlines() if "note:" in line])
    assert notes[0] == notes[1] and any("clamped to |d| = 1e-05" in n for n in notes[0]), notes


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kerple_power_written_causally_takes_its_limit_at_the_diagonal(tmp_path, backend):
    """-r1*d**r2: its derivative in r2, -r1*d**r2*log(d), is 0*log 0 at d = 0, the key every
    causal row holds. Its limit, 0, is taken there, as for GGD's |d|**beta; the scan found it
    nan and refused the file before."""
    module = bamgen.load(write_prior(tmp_path, KERPLE_POWER), cache_dir=tmp_path / "cache")
    q, k, v, dout = _inputs(Nq=7, Nk=19)
    params = {"r1": torch.tensor([0.7, 1.5]), "r2": torch.tensor([0.5, 1.3])}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    theta = {name: value.clone().requires_grad_() for name, value in params.items()}
    out = module.attention(*leaves, **theta, q_offset=12, backend=backend)
    grads = torch.autograd.grad(out, leaves + list(theta.values()), dout)

    def log_prior(d, p):
        return -p["r1"] * d.clamp(min=0) ** p["r2"]

    kw = dict(causal=True, dout=dout, q_offset=12)
    ref = reference_attention(q, k, v, params, log_prior, **kw)
    pt = reference_attention(q, k, v, params, log_prior, compute_dtype=torch.float32, **kw)
    results = [("out", out, ref.out, pt.out), ("dq", grads[0], ref.dq, pt.dq),
               ("dk", grads[1], ref.dk, pt.dk), ("dv", grads[2], ref.dv, pt.dv),
               ("dr1", grads[3], ref.dparams["r1"], pt.dparams["r1"]),
               ("dr2", grads[4], ref.dparams["r2"], pt.dparams["r2"])]
    assert all(torch.isfinite(r).all() for _, r, _, _ in results)
    assert_all_close(results, torch.float32, context=backend)
