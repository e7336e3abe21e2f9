"""A learnable parameter whose gradient is 0 everywhere (a hard window's width, which appears
only in a condition) builds, with a warning that names it and suggests learnable: false: at
`bamgen build`, in `bamgen show` and as a PriorWarning from bamgen.load."""
from __future__ import annotations

import warnings

import pytest

import bamgen
from bamgen.errors import PriorWarning
from tests.helpers import run_cli, write_prior
from tests.tolerance import assert_all_close

WINDOW = """
name: hard_window
log_prior: Piecewise((-Abs(d)/b, Abs(d) <= W), (-oo, True))
params:
  b: {init: 8.0, domain: positive}
  W: {init: 64.0, domain: positive}
"""
WORDS = ("field 'params.W'", "the learnable parameter 'W' gets no gradient",
         "only in a Piecewise condition", "learnable: false")


def test_build_warns_once_names_the_parameter_and_writes(tmp_path):
    prior = write_prior(tmp_path, WINDOW)
    res = run_cli("build", str(prior), "-o", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"warning: {prior}:6:"), res.stderr
    assert all(word in lines[0] for word in WORDS), lines[0]
    assert "'b'" not in lines[0]   # b is read by the value: it gets its gradient
    assert (tmp_path / "out" / "hard_window.py").is_file()
    shown = run_cli("show", str(prior))
    assert shown.returncode == 0
    assert [line for line in shown.stdout.splitlines() if line.startswith("warning: ")] == lines


def test_a_buffer_or_an_ordinary_parameter_gives_no_warning(tmp_path):
    buffer = WINDOW.replace("{init: 64.0, domain: positive}",
                            "{init: 64.0, domain: positive, learnable: false}")
    for text in (buffer, "log_prior: -Abs(d)/b\nparams:\n  b: {init: 8.0, domain: positive}\n"):
        res = run_cli("build", str(write_prior(tmp_path, text)), "-o", str(tmp_path / "out"))
        assert res.returncode == 0 and res.stderr == "", res.stderr


def test_a_parameter_the_formula_never_reads(tmp_path):
    text = "log_prior: -Abs(d)/b\nparams:\n  b: {init: 8.0, domain: positive}\n  c: {init: 1.0}\n"
    res = run_cli("build", str(write_prior(tmp_path, text)), "-o", str(tmp_path / "out"))
    assert res.returncode == 0
    assert "'c' gets no gradient" in res.stderr and "never reads it" in res.stderr, res.stderr


def test_load_warns(tmp_path):
    prior = write_prior(tmp_path, WINDOW)
    with pytest.warns(PriorWarning) as caught:
        module = bamgen.load(prior, cache_dir=tmp_path / "cache")
    assert len(caught) == 1 and all(word in str(caught[0].message) for word in WORDS)
    assert caught[0].filename == __file__   # pointed at the caller of bamgen.load
    assert len(module.PRIOR["warnings"]) == 1 and module.PRIOR["warnings"][0] in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bamgen.load("laplace", cache_dir=tmp_path / "cache")


def test_a_prior_loaded_again_warns_once_at_the_user_s_line(tmp_path, monkeypatch):
    """Loaded five times, and once more through bamgen's own code (apply_prior's resolve_prior):
    one warning, at the caller's line. Python's once-per-line record is reset whenever code
    changes the warning filters (the formula parser does), so five loads printed five."""
    from bamgen.driver import loader
    from bamgen.integrations.transformers import resolve_prior
    monkeypatch.setattr(loader, "_WARNED", set())
    monkeypatch.setenv("BAMGEN_CACHE_DIR", str(tmp_path / "cache"))
    prior = write_prior(tmp_path, WINDOW)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve_prior(str(prior))
        for _ in range(5):
            bamgen.load(prior)
    shown = [w for w in caught if issubclass(w.category, PriorWarning)]
    assert len(shown) == 1, [str(w.message) for w in shown]
    assert shown[0].filename == __file__   # the user's line, not bamgen's


# --------------------------------------------------------------------------------------------
# steps as values: floor and ceiling of the distance or of a parameter (an outside test found
# both an internal error: the chain rule's Subs(Derivative(floor)) and a ramp's slope gradient)

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_floor_of_the_distance_builds_and_matches_the_reference(tmp_path, backend):
    import torch
    text = "name: steps\nlog_prior: -floor(Abs(d)/4)/b\nparams:\n  b: {init: 1.0, domain: positive}\n"
    module = bamgen.load(write_prior(tmp_path, text), cache_dir=tmp_path / "cache")
    g = torch.Generator().manual_seed(3)
    Nq, Nk = 9, 40
    q, k, v = (torch.randn(1, 2, n, 16, generator=g, dtype=torch.float64) for n in (Nq, Nk, Nk))
    b = torch.tensor([0.7, 1.3], dtype=torch.float64)
    d = (torch.arange(Nq)[:, None] + Nk - Nq - torch.arange(Nk)[None]).double()

    def reference(q, k, v, b):
        s = q @ k.transpose(-1, -2) / 4 - torch.floor(d.to(q.dtype).abs() / 4) / b[:, None, None]
        return torch.softmax(s.masked_fill(d < 0, -float("inf")), -1) @ v

    leaves = [t.float().requires_grad_() for t in (q, k, v, b)]
    out = module.attention(*leaves[:3], b=leaves[3], q_offset=Nk - Nq, backend=backend)
    got = (out, *torch.autograd.grad(out.square().sum(), leaves))
    results = []
    for dtype in (torch.float64, torch.float32):   # the reference, and the naive float32 one
        ref_leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, b)]
        ref = reference(*ref_leaves)
        results.append((ref, *torch.autograd.grad(ref.square().sum(), ref_leaves)))
    assert_all_close([(name, a, w, p) for name, a, w, p in zip(("out", "dq", "dk", "dv", "db"),
                                                                got, *results)], torch.float32)


@pytest.mark.parametrize("formula", ["-floor(W)*Abs(d)", "-ceiling(Abs(d)/W)"])
def test_a_parameter_under_floor_or_ceiling_builds_with_the_warning(tmp_path, formula):
    text = f"name: steps\nlog_prior: {formula}\nparams:\n  W: {{init: 2.5, domain: positive}}\n"
    res = run_cli("build", str(write_prior(tmp_path, text)), "-o", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    assert "the learnable parameter 'W' gets no gradient" in res.stderr, res.stderr
    assert (tmp_path / "out" / "steps.py").exists()
