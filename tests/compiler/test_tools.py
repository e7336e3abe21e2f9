"""`bamgen show`, `bamgen plot` and the analysis behind them."""
import pytest

from bamgen.compiler.analysis import analyse_prior
from bamgen.compiler.spec import load_spec
from bamgen.compiler.symbolic import analyse
from tests.helpers import ROOT, run_cli, run_cli_in_process, write_prior

PRIORS = ROOT / "priors"


@pytest.mark.parametrize("name, symmetric, tail, normalisable", [
    ("uniform", True, "flat", False),
    ("laplace", True, "exponential-type (log-prior ~ -|d|^1.00)", True),
    ("gaussian", True, "exponential-type (log-prior ~ -|d|^2.00)", True),
    ("cauchy", True, "polynomial (prior ~ |d|^-2.00)", True),
    ("kerple_log", True, "polynomial (prior ~ |d|^-1.00)", False),
])
def test_analysis_classifies_the_shipped_priors(name, symmetric, tail, normalisable):
    analysis = analyse_prior(analyse(load_spec(PRIORS / f"{name}.yaml")), num_heads=4)
    assert analysis.symmetric is symmetric
    assert analysis.tail.startswith(tail)
    assert analysis.normalisable is normalisable


def test_the_tail_of_a_prior_of_positions_holds_the_key_in_place(tmp_path):
    """Far away the query moves away from a key held in place: a key held at i - 10**6 would
    sit before position 0, where log(1 + j) is undefined and no key is."""
    text = ("name: posd\nlog_prior: -Abs(d)/b*log(2 + i) + log(1 + j)/10\n"
            "params:\n  b: {init: 2.0, domain: positive}\n")
    analysis = analyse_prior(analyse(load_spec(write_prior(tmp_path, text))), num_heads=2)
    assert analysis.tail.startswith("exponential-type"), analysis.tail
    assert analysis.normalisable is True


def test_reach_and_mode_of_alibi_heads():
    analysis = analyse_prior(analyse(load_spec(PRIORS / "laplace.yaml")), num_heads=4)
    # -|d|/b < -20 first at |d| = 20*b + 1 for b = 4, 16, 64, 256
    assert [h.reach for h in analysis.heads] == [81.0, 321.0, 1281.0, 5121.0]
    assert all(h.mode == 0 for h in analysis.heads)


def test_shifted_mode_and_asymmetry(tmp_path):
    prior = write_prior(tmp_path, """
        name: shifted
        log_prior: -(d - mu)**2 / 8
        params:
          mu: {init: "3 + h"}
        """)
    analysis = analyse_prior(analyse(load_spec(prior)), num_heads=2)
    assert [h.mode for h in analysis.heads] == [3, 4]
    assert not analysis.symmetric


def test_show_prints_derivatives_plan_and_analysis():
    res = run_cli("show", str(PRIORS / "generalized_gaussian.yaml"), "--heads", "2")
    assert res.returncode == 0, res.stderr
    for words in ("d logit / d beta", "Piecewise", "strategy table", "cost model", "torch.pow",
                  "tail: exponential-type", "normalisable over the integers: yes"):
        assert words in res.stdout


def test_show_analyses_a_grid_prior_along_its_first_channel():
    """A prior over C > 1 channels (positions: 2) is analysed along d0 with d1 = 0; the analysis
    substituted d alone, so `bamgen show alibi_2d` stopped with an internal error."""
    res = run_cli("show", str(PRIORS / "alibi_2d.yaml"), "--heads", "2")
    assert res.returncode == 0, res.stderr
    assert "(along d0, with d1 = 0)" in res.stdout
    # -(|d0| + 0)/b < -20 first at |d0| = 20*b + 1 for b = 2**(8*(h + 1)/2) = 16, 256
    analysis = analyse_prior(analyse(load_spec(PRIORS / "alibi_2d.yaml")), num_heads=2)
    assert [h.reach for h in analysis.heads] == [321.0, 5121.0]
    assert analysis.symmetric and analysis.tail.startswith("exponential-type")


def test_show_reports_a_bad_file_in_one_line(tmp_path):
    bad = write_prior(tmp_path, "name: x\nlog_prior: -q\n")
    res = run_cli("show", str(bad))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1


def test_analysis_of_a_window_prior(tmp_path):
    """A hard window is -oo on both sides beyond it: symmetric (the same infinity, not a nan
    difference), its tail compact and normalisable."""
    prior = write_prior(tmp_path, """
        name: window
        log_prior: Piecewise((-Abs(d) / b, Abs(d) <= 6), (-oo, True))
        params:
          b: {init: 4.0, domain: positive}
        """)
    analysis = analyse_prior(analyse(load_spec(prior)), num_heads=2)
    assert analysis.symmetric is True
    assert analysis.tail.startswith("compact") and analysis.normalisable is True


def test_show_reports_a_formula_the_domain_scan_refuses_in_one_line(tmp_path):
    """A file that parses but is nan somewhere in the domain (log of a negative number far
    away): show plans the kernels, whose scan refuses it, in one line naming the field, exit 2,
    as build does, not with a traceback."""
    bad = write_prior(tmp_path, "name: far_nan\nlog_prior: log(10 - Abs(d))\n")
    res = run_cli("show", str(bad))
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert "field 'log_prior'" in res.stderr and str(bad) in res.stderr


@pytest.mark.parametrize("name, magic", [("p.png", b"\x89PNG\r\n\x1a\n"), ("p.svg", b"<?xml"),
                                         ("p.PDF", b"%PDF-"), ("p.jpg", b"\xff\xd8\xff")])
def test_plot_writes_the_format_its_out_file_names(tmp_path, name, magic):
    """plot wrote PNG only and refused any other name; now the extension picks any format
    matplotlib writes (a vector .svg or .pdf for a paper)."""
    pytest.importorskip("matplotlib")
    out = tmp_path / name
    res = run_cli_in_process("plot", str(PRIORS / "kerple_power.yaml"), "-o", str(out),
                             "--heads", "3")
    assert res.exit_code == 0 and res.stdout == f"wrote {out}\n", res.output
    data = out.read_bytes()
    assert data.startswith(magic)
    assert name != "p.svg" or b"<svg" in data[:1000]


@pytest.mark.parametrize("name", ["p.txt", "p"])
def test_plot_refuses_an_extension_matplotlib_cannot_write_naming_the_flag(tmp_path, name):
    pytest.importorskip("matplotlib")
    out = tmp_path / name
    res = run_cli_in_process("plot", "laplace", "-o", str(out))
    assert res.exit_code == 2, res.output
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --out {out}: "), res.stderr
    assert all(ext in lines[0] for ext in (".png", ".svg", ".pdf"))
    assert list(tmp_path.iterdir()) == []


def test_show_plot_and_inspect_take_a_shipped_prior_s_name_as_build_does(tmp_path):
    """`bamgen build laplace` builds the shipped prior by name; show, plot and inspect took
    only a path ("cannot read the file", and click's own usage error from inspect). A name
    that is no shipped prior is one line naming the shipped ones, exit 2."""
    res = run_cli("show", "laplace", "--heads", "2")
    assert res.returncode == 0, res.stderr
    assert "prior 'laplace'" in res.stdout and "causal side" in res.stdout
    png = tmp_path / "laplace.png"
    res = run_cli("plot", "laplace", "-o", str(png), "--heads", "2")
    assert res.returncode == 0 and png.stat().st_size > 0, res.stderr
    for command in (["show", "nosuch"], ["plot", "nosuch", "-o", str(tmp_path / "x.png")],
                    ["inspect", "nosuch"]):
        res = run_cli(*command)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert "no shipped prior named 'nosuch'" in res.stderr and "laplace" in res.stderr
    res = run_cli("inspect", "uniform", "--head-dim", "16", "--kernel", "attn_fwd")
    assert res.returncode == 0 and "uniform: sm_90" in res.stdout, res.stderr
    res = run_cli("inspect", str(tmp_path / "gone.py"))
    assert res.returncode == 2 and "gone.py: no such file" in res.stderr


def test_inspect_refuses_a_py_file_bamgen_did_not_generate_without_running_it(tmp_path):
    """`bamgen inspect x.py` imported (ran) any .py, then reported 'internal error while
    compiling for sm_90 (AttributeError: ... no attribute 'triton_kernel_specs')'. A file
    without bamgen's header is refused unrun; one with the header and not the rest, once run."""
    ran = tmp_path / "ran"
    script = tmp_path / "not_generated.py"
    script.write_text(f"open({str(ran)!r}, 'w').close()\nx = 1\n")
    posing = tmp_path / "posing.py"
    posing.write_text("# Generated by bamgen 0.1.0 from posing.yaml. Do not edit.\nx = 1\n")
    for path in (script, posing):
        res = run_cli("inspect", str(path), cwd=tmp_path)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and f"{path}: not a module bamgen generated" in lines[0], res.stderr
        assert "bamgen build" in lines[0] and "internal error" not in lines[0]
    assert not ran.exists()


@pytest.mark.parametrize("name", ["laplace", "alibi_2d", "generalized_gaussian", "bam", "kerple_power"])
def test_the_analysis_inits_are_the_module_s(name):
    """`bamgen show` and the build's checks compute an init in float64 as a tree of products
    and powers; the module prints it as Python. They disagreed where rounding decides a floor:
    ALiBi's init in laplace reads floor(log(H)/log(2)), which the analysis computed as
    log(H) * (1/log(2)) = 2.9999999999999996 at H = 8 (so `show` gave 8 heads the slopes of 4),
    where the module divides, 3.0. A quotient is now divided in both. Every head count to 64:
    the analysis's values, rounded to float32, are the module's."""
    import importlib

    import torch
    from bamgen.compiler.analysis import init_values
    ir = analyse(load_spec(PRIORS / f"{name}.yaml"))
    module = importlib.import_module(f"generated.{name}")
    for heads in range(1, 65):
        analysed = init_values(ir, heads)
        for param, values in module.default_params(heads).items():
            symbol = next(s for s in analysed[0] if s.name == param)
            want = torch.tensor([head[symbol] for head in analysed], dtype=torch.float64).float()
            assert torch.equal(values, want), (heads, param, values, want)
