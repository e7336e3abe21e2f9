"""Stage 1: prior files to PriorSpec, the formula whitelist, the names a parameter may not have,
values as the module computes them, and the time bounds of a build."""
import ast
import math
import re

import pytest
import sympy as sp
import torch

from bamgen.compiler import spec as spec_module
from bamgen.checks.inits import check_inits
from bamgen.driver.build import compile_spec
from bamgen.errors import SpecError
from bamgen.compiler.formula import KEYWORD_NAMES, REWRITES, ElementSymbol, parse_formula
from bamgen.compiler.spec import load_spec, parse_spec
from tests.helpers import run_cli_in_process, write_prior

D = sp.Symbol("d", real=True)
SYMS = {"d": D, "b": sp.Symbol("b", positive=True)}

GOOD = """
name: demo
log_prior: -Abs(d) / b
params:
  b: {init: "2**(8*(h + 1)/H)", domain: positive}
"""


def test_good_file_parses_with_params_and_domains():
    spec = parse_spec(GOOD)
    assert spec.name == "demo" and spec.class_name == "DemoAttention"
    (b,) = spec.params
    assert b.name == "b" and b.learnable and b.per_head and b.domain.kind == "positive"
    assert spec.log_prior == -sp.Abs(D) / b.symbol()
    assert len(spec.source_hash) == 64


@pytest.mark.parametrize("formula, expected", [
    ("-Abs(d)/b", -sp.Abs(D) / SYMS["b"]),
    ("-(Abs(d)/b)**2", -(sp.Abs(D) / SYMS["b"]) ** 2),
    ("Piecewise((-d, d < 8), (-oo, True))", sp.Piecewise((-D, D < 8), (-sp.oo, True))),
    ("Min(d, 3) + Max(d, 1, 2)", sp.Min(D, 3) + sp.Max(D, 1, 2)),
    ("1e-5 + d", sp.Float("1e-5") + D),
    # SymPy's relations as calls, as `bamgen show` prints them: Eq(d, 0) is d == 0
    ("Piecewise((1, Eq(d, 0)), (-Abs(d), True))", sp.Piecewise((1, sp.Eq(D, 0)), (-sp.Abs(D), True))),
    ("Piecewise((1, Ne(d, 0) & Le(d, 5)), (0, True))",
     sp.Piecewise((1, sp.And(sp.Ne(D, 0), D <= 5)), (0, True))),
    ("Piecewise((1, Gt(d, 2) | Lt(d, -2) | Ge(d, 9)), (0, True))",
     sp.Piecewise((1, sp.Or(D > 2, D < -2, D >= 9)), (0, True))),
])
def test_whitelisted_formulas(formula, expected):
    assert parse_formula(formula, SYMS, field="log_prior") == expected


@pytest.mark.parametrize("formula, words", [
    ("__import__('os').system('true')", "cannot be called"),
    ("__import__('os')", "unknown function '__import__'"),
    ("d.__class__", "attribute access"),
    ("(lambda: 1)()", "cannot be called"),
    ("[x for x in d]", "comprehension"),
    ("exp", "must be called"),
    ("foo(d)", "unknown function"),
    ("q * d", "unknown symbol 'q'"),
    ("_secret", "unknown symbol '_secret'"),
    ("9**9**9", "too large"),
    ("d ** 100000", "too large"),
    ("1" + "0" * 20, "larger than"),
    ("-" * 40 + "d", "nested deeper"),
    ("d < 3", "condition was used"),
    ("exp(d, d)", "takes 1 argument"),
    ("Eq(d, 0)", "condition was used"),
    ("Piecewise((0, Eq(d)), (1, True))", "Eq takes 2 arguments"),
    ("Piecewise((0, Ne(d, x=1)), (1, True))", "keyword arguments"),
    ("Piecewise((d, d < 1))", "condition True"),
    ("d +", "cannot parse"),
    ("", "empty"),
])
def test_rejected_formulas_name_the_problem(formula, words):
    with pytest.raises(SpecError) as err:
        parse_formula(formula, SYMS, field="log_prior")
    assert words in str(err.value) and "log_prior" in str(err.value)


@pytest.mark.parametrize("text, field, words", [
    ("", None, "empty"),
    ("- a\n- b\n", None, "mapping"),
    ("name: x\n", "log_prior", "exactly one"),
    ("name: x\nlog_prior: 0\ndensity: 1\n", "log_prior", "exactly one"),
    ("name: Bad-Name\nlog_prior: 0\n", "name", "invalid name"),
    ("name: x\nlog_prior: 0\nextra: 1\n", "extra", "unknown field"),
    ("name: x\nlog_prior: -d/b\nparams:\n  b: {domain: positive}\n", "params.b.init", "missing 'init'"),
    ("name: x\nlog_prior: -d/b\nparams:\n  b: {init: -1, domain: positive}\n", "params.b.init", "outside the domain"),
    ("name: x\nlog_prior: -d/b\nparams:\n  b: {init: 1, domain: wobbly}\n", "params.b.domain", "invalid domain"),
    ("name: x\nlog_prior: -d*exp\nparams:\n  exp: 1.0\n", "params.exp", "reserved"),
    ("name: x\nlog_prior: -d*d\nparams:\n  d: 1.0\n", "params.d", "reserved"),
    ("name: x\nlog_prior: !!python/object/apply:os.system ['true']\n", None, "not valid YAML"),
    ("name: x\nlog_prior: -d/0\n", "log_prior", "not finite"),
    ("name: x\nlog_prior: -d\nscore: log_prior\n", "score", "does not use s"),
    ("name: x\nlog_prior: -d/b\nparams:\n  b: {init: 1, learnable: maybe}\n", "params.b.learnable", "true or false"),
    ("name: x\nlog_prior: -(" + " + ".join(f"Abs(d - {k})" for k in range(17)) + ")\n",
     "log_prior", "distinct kinks"),
    # position channels (docs/positions.md)
    ("name: x\npositions: 0\nlog_prior: -Abs(d0)\n", "positions", "from 1 to 4"),
    ("name: x\npositions: 5\nlog_prior: -Abs(d0)\n", "positions", "from 1 to 4"),
    ("name: x\npositions: two\nlog_prior: -Abs(d0)\n", "positions", "whole number"),
    ("name: x\npositions: true\nlog_prior: -Abs(d0)\n", "positions", "whole number"),
    ("name: x\npositions: 2\nlog_prior: -Abs(d)\n", "log_prior", "unknown symbol 'd'"),
    ("name: x\npositions: 2\nlog_prior: -Abs(d2)\n", "log_prior", "unknown symbol 'd2'"),
    ("name: x\npositions: 2\nlog_prior: -Abs(d0)/d1\nparams:\n  d1: 1.0\n", "positions",
     "position symbol"),
    ("name: x\nlog_prior: -Abs(d)/pos_q\nparams:\n  pos_q: 1.0\n", "params.pos_q", "reserved"),
])
def test_bad_files_name_the_field(text, field, words):
    with pytest.raises(SpecError) as err:
        spec = parse_spec(text)
        # some errors surface when the mathematics is built
        from bamgen.compiler.symbolic import analyse
        analyse(spec)
    message = str(err.value)
    assert words in message, message
    if field:
        assert f"field '{field}'" in message, message


def test_binary_file_is_refused():
    with pytest.raises(SpecError, match="not UTF-8"):
        parse_spec(b"\xff\xfe\x00garbage")


def test_constant_value_is_folded_and_integral_values_stay_integers():
    spec = parse_spec("name: x\nlog_prior: -(Abs(d)/a)**beta\nparams:\n  a: 2.0\n  beta: {value: 2}\n")
    assert [p.name for p in spec.params if not p.is_constant] == ["a"]
    assert spec.log_prior.has(sp.Pow(sp.Abs(D) / sp.Symbol("a", real=True), 2)) or \
        any(p.exp == 2 for p in spec.log_prior.atoms(sp.Pow))


def test_error_carries_the_line_of_the_field():
    text = "name: x\n\nlog_prior: -d/b\nparams:\n  b: {init: 0, domain: positive}\n"
    with pytest.raises(SpecError) as err:
        parse_spec(text, path="p.yaml")
    assert str(err.value).startswith("p.yaml:5:")


# --------------------------------------------------------------------------------------------
# names that would collide with the generated code

SENTINEL = re.compile(r"zq[a-d]")
# Priors whose parameters are named zqa..zqd, so that every name the generated code derives
# from a parameter can be told from the templates' own names. Together they render every
# template branch a parameter reaches: the table and the inline strategies, the causal ramp,
# a score that is not s + log_prior, buffers and positions i, j, n.
SENTINEL_PRIORS = {
    "table_score": ("log_prior: -(Abs(d - zqc)/zqa)**zqb\nscore: (s + log_prior) * zqd\n"
                    "params:\n  zqa: {init: 2.0, domain: positive}\n"
                    "  zqb: {init: 1.0, domain: positive}\n  zqc: {init: 0.0, learnable: false}\n"
                    "  zqd: {init: 1.0}\n"),
    "table": ("log_prior: -(Abs(d - zqc)/zqa)**zqb\nparams:\n  zqa: {init: 2.0, domain: positive}\n"
              "  zqb: {init: 1.0, domain: positive}\n  zqc: {init: 0.0, learnable: false}\n"),
    "ramp": ("log_prior: -Abs(d)/zqa - zqb*Abs(d)\nparams:\n  zqa: {init: 2.0, domain: positive}\n"
             "  zqb: {init: 1.0, domain: positive, learnable: false}\n"),
    "positions": ("log_prior: -Abs(d)/zqa - zqb*Abs(i)/(Abs(j) + 1) - zqc*log(n)\nparams:\n"
                  "  zqa: {init: 2.0, domain: positive}\n  zqb: {init: 1.0, domain: positive}\n"
                  "  zqc: {init: 0.0, learnable: false}\n"),
}


def _scope_names(fn: ast.AST) -> set[str]:
    """Identifiers a function (with the functions nested in it) binds or reads, without the
    targets of its comprehensions (they have a scope of their own)."""
    names, bound_in_comprehensions = set(), set()
    for node in ast.walk(fn):
        if isinstance(node, ast.comprehension):
            bound_in_comprehensions |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names - bound_in_comprehensions


def _clashing_names() -> dict[str, set[str]]:
    """{a parameter name that would clash: the generated identifiers it clashes with}, from
    the rendered modules: in every function where the code derives an identifier from a
    parameter (the parameter itself, prm_p, tab_p, grad_p, dlogit_dp, ...), any other
    identifier of that form names a parameter that would collide."""
    clashes: dict[str, set[str]] = {}
    for key, text in SENTINEL_PRIORS.items():
        for strategy in (None, "inline"):
            artifact = compile_spec(parse_spec(f"name: sentinel_{key}\n{text}"), strategy)
            for fn in ast.walk(ast.parse(artifact.text)):
                if not isinstance(fn, (ast.FunctionDef, ast.Lambda)):
                    continue
                names = _scope_names(fn)
                patterns = {SENTINEL.sub("{}", n) for n in names if SENTINEL.search(n)}
                own = {n for n in names if not SENTINEL.search(n)}
                for pattern in patterns:
                    prefix, suffix = pattern.split("{}")
                    for name in own:
                        inner = name[len(prefix):len(name) - len(suffix)]
                        if (name.startswith(prefix) and name.endswith(suffix) and inner
                                and re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", inner)):
                            clashes.setdefault(inner, set()).add(name)
    return clashes


def test_every_name_the_generated_code_uses_works_as_a_parameter():
    """A parameter may take any name but the language's or an argument of attention(), a
    Python keyword included: the compiler renames its own names around it. Derived from the rendered
    modules (the arguments, locals and called functions of every generated function, and the
    names the printed hooks derive from a parameter), each such name is given to a parameter of
    a prior that uses it, and the module must compute what the same prior with plain names
    computes, learn through it, and store it in its state dict."""
    import torch
    clashes = _clashing_names()
    assert {"stats", "num_heads", "out", "dout", "attention"} <= set(clashes)   # the check sees them
    names = sorted(n for n in clashes if not spec_module._reserved_because(n))
    # Python's keywords, which the formulas and the generated signatures cannot spell as names
    names += sorted(KEYWORD_NAMES) + ["keyword_params", "keyword_lambda" + "_" * 50]
    # and the hooks' own names, the module's globals, nn.Module's attributes and builtins
    names += ["prm", "pos_d", "tab", "tab_v", "sc", "Theta_h", "tl", "torch", "math", "values",
              "element_at", "init_formula", "c0", "x0", "k0", "_prior", "training", "forward",
              "raw_b", "_parameters", "self", "float", "range", "_element", "TRAITS", "PRIOR"]
    for start in range(0, len(names), 30):
        chunk = names[start:start + 30]
        values = {n: 0.25 + k / 64 for k, n in enumerate(chunk)}
        plain = {f"p{k}": v for k, v in enumerate(values.values())}
        mods = []
        for params in (values, plain):
            body = " + ".join(f"{n}*Abs(d)**{1 + k % 3}" for k, n in enumerate(params))
            decl = "".join(f"  {n}: {{init: {v}, domain: positive}}\n" for n, v in params.items())
            text = f"name: names_{start}\nlog_prior: -({body})/1000\nparams:\n{decl}"
            mods.append(_module(compile_spec(parse_spec(text)).text))
        q, k, v = (torch.randn(1, 2, 9, 8, dtype=torch.float64) for _ in range(3))
        outs = [mods[0].attention(q, k, v, **values), mods[1].attention(q, k, v, **plain)]
        # (SymPy orders a sum's terms by name: the same values, summed in another order)
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-13, atol=1e-13, msg=str(chunk))
        layer = mods[0].__dict__[mods[0].PRIOR["class_name"]](num_heads=2)
        state = layer.state_dict()
        assert len(state) == len(chunk) and set(layer.prior_params()) == set(chunk)
        layer(q.float(), k.float(), v.float()).sum().backward()
        assert all(p.grad is not None for p in layer.parameters())


def _module(text):
    import types
    module = types.ModuleType("names_under_test")
    exec(compile(text, "<names_under_test>", "exec"), module.__dict__)
    return module


def test_module_attributes_cover_torch_nn_module():
    import torch
    from bamgen.compiler.codegen import MODULE_ATTRIBUTES
    module = torch.nn.Module()
    public = {n for n in set(dir(torch.nn.Module)) | set(vars(module)) if not n.startswith("_")}
    assert public <= MODULE_ATTRIBUTES, sorted(public - MODULE_ATTRIBUTES)


@pytest.mark.parametrize("name, words", [
    ("key_mask", "argument of the generated attention()"),
    ("cu_seqlens_q", "argument of the generated attention()"), ("q", "attention()"),
    ("None", "constant or operator of the formula language"),
    ("and", "constant or operator of the formula language"),
    ("or", "constant or operator of the formula language"),
    ("exp", "formula language"), ("Sum", "formula language"),
    ("cos", "formula language"), ("n", "formula language"),
])
def test_reserved_parameter_names_say_why_and_suggest_a_name(name, words):
    with pytest.raises(SpecError) as err:
        parse_spec(f"name: x\nlog_prior: -Abs(d)\nparams:\n  {name}: {{init: 1.0}}\n")
    message = str(err.value)
    assert f"field 'params.{name}'" in message and words in message, message
    suggestion = re.search(r"e\.g\. (\w+)\)", message).group(1)
    assert not spec_module._reserved_because(suggestion)


@pytest.mark.parametrize("name", ["torch", "math", "triton", "numpy", "sympy", "json", "random",
                                  "bamgen", "generated"])
def test_a_prior_named_like_an_importable_module_is_refused(name):
    with pytest.raises(SpecError, match=f"would hide the module '{name}'"):
        parse_spec(f"name: {name}\nlog_prior: -Abs(d)\n")


def test_compiler_temporaries_never_take_a_parameters_name():
    """c0 is a hoisted temporary's usual name: with a parameter c0 the temporaries skip it, and
    the printed code reads the parameter as prm_c0 everywhere."""
    from bamgen.compiler.lower import plan
    from bamgen.compiler.symbolic import analyse
    ir = analyse(parse_spec("name: x\nlog_prior: -Abs(d)/c0 - x0*Abs(d)**1.5\nparams:\n"
                            "  c0: {init: 4.0, domain: positive}\n  x0: {init: 0.5}\n"))
    kernel_plan = plan(ir, "inline")
    for block in (kernel_plan.torch_bwd, kernel_plan.triton_bwd, kernel_plan.torch_fwd):
        assigned = {name for name, _ in block.hoisted + block.body}
        assert not assigned & {"c0", "x0"}, assigned
        code = " ".join(c for _, c in block.hoisted + block.body) + " ".join(block.outputs)
        assert re.search(r"(?<![\w])c0(?![\w])", code) is None, code


def test_the_printer_refuses_a_symbol_it_has_no_name_for():
    """Names are looked up by symbol, assumptions included: a parameter c0 (positive) is not
    the temporary c0 (real), and printing one for the other is an error, never a silent swap."""
    from bamgen.compiler.printers import print_expr
    param, temp = sp.Symbol("c0", positive=True), sp.Symbol("c0", real=True)
    assert print_expr(param + temp, {param: "prm_c0", temp: "c0"}, target="torch") in (
        "c0 + prm_c0", "prm_c0 + c0")
    with pytest.raises(KeyError):
        print_expr(temp * 2, {param: "prm_c0"}, target="torch")


# --------------------------------------------------------------------------------------------
# values as the module computes them


@pytest.mark.parametrize("init, words", [
    ('"1 - h/100"', "gives 0.0 for head 100 of 101, outside the domain positive"),
    ('"1/Abs(H - 100)"', "gives inf for head 0 of 100"),
    ('"exp(100)"', "beyond float32's largest value"),
    ('"1e-45"', "below float32's smallest normal value 1.1754944e-38"),
    # 2**128 is 3.402823669209385e+38: the bound is given in full, where "beyond 3.4e38" read
    # as if the value were the bound
    ('"2**(h + 1)"', "gives 3.402823669209385e+38 for head 127 of 128, beyond float32's "
                     "largest value 3.4028235e+38: float32 stores it as inf"),
    ('"2**(h - 1000)"', "for head 0 of 1"),
])
def test_inits_are_checked_for_every_head_count_in_float32(init, words):
    with pytest.raises(SpecError) as err:
        check_inits(parse_spec(f"name: x\nlog_prior: -Abs(d)/b\nparams:\n  b: {{init: {init}, domain: positive}}\n"))
    assert "field 'params.b.init'" in str(err.value) and words in str(err.value), str(err.value)


def test_an_init_that_overflows_float32_is_refused_with_both_numbers_in_full(tmp_path):
    text = 'name: x\nlog_prior: -Abs(d)/b\nparams:\n  b: {init: "2**(h + 1)", domain: positive}\n'
    res = run_cli_in_process("build", str(write_prior(tmp_path, text)), "-o", str(tmp_path / "out"))
    assert res.exit_code == 2 and not (tmp_path / "out").exists()
    line = res.stderr.strip()
    assert "\n" not in line and "field 'params.b.init': the init gives 3.402823669209385e+38" in line
    assert "largest value 3.4028235e+38: float32 stores it as inf" in line, line


def test_an_init_fine_for_every_head_count_up_to_the_bound_passes():
    check_inits(parse_spec('name: x\nlog_prior: -Abs(d)/b\nparams:\n  b: {init: "2**(8*(h + 1)/H)", domain: positive}\n'))
    check_inits(parse_spec('name: x\nlog_prior: -Abs(d)/b\nparams:\n  b: {init: "1 - h/1025", domain: positive}\n'))


@pytest.mark.parametrize("domain, words", [
    ("[1.0, 1.00000001]", "holds no float32 value"),
    ("[0.0, 1.0e+39]", "beyond float32's range"),
    ("[-3.0e+38, 3.0e+38]", "beyond float32's range"),      # hi - lo overflows
    ("[0.0, 1.0e-40]", "smallest normal"),
])
def test_intervals_must_hold_float32_values(domain, words):
    with pytest.raises(SpecError) as err:
        parse_spec(f"name: x\nlog_prior: -Abs(d)*b\nparams:\n  b: {{init: 0.5, domain: {domain}}}\n")
    assert "field 'params.b.domain'" in str(err.value) and words in str(err.value), str(err.value)


def test_constants_sympy_would_settle_exactly_are_computed_in_float64():
    """floor(exp(700)) needs 300 exact digits; SymPy raised PrecisionExhausted."""
    expr = parse_formula("d * floor(exp(700))", SYMS, field="log_prior")
    assert expr.has(sp.Float) and not expr.has(sp.floor)
    with pytest.raises(SpecError, match="cannot be decided in floating point"):
        parse_formula("Piecewise((d, tanh(500) < 1), (0, True))", SYMS, field="log_prior")
    assert parse_formula("Piecewise((d, 1 < 2), (0, True))", SYMS, field="log_prior") == D


def test_yaml_merge_keys_are_refused_before_they_are_expanded():
    text = "name: x\nlog_prior: -Abs(d)*b\nparams:\n  a: &a {init: 1.0}\n  b: {<<: *a}\n"
    with pytest.raises(SpecError, match=r"merge keys \('<<'\)") as err:
        parse_spec(text)
    assert "field 'params.b'" in str(err.value)
    # an alias without a merge is only a reference: fine
    parse_spec("name: x\nlog_prior: &f -Abs(d)\ndescription: *f\n")


def test_the_scan_finds_what_the_check_points_miss():
    """A formula fine at a handful of points but nan between them, and one that is right in
    float64 but not in the kernels' float32, are refused by the build (bamgen/checks/scan.py)."""
    cases = {
        "log(50 - Abs(d))": "the log-prior is nan",
        "-Abs(d)/4 + 1/(d - 1000000)": "the log-prior is +inf at d = 1000000",
        # a pole behind an Abs: a root of d - 100000 or -d - 100000 (an outside test built it)
        "-Abs(d)/4 + 1/(Abs(d) - 100000)": "the log-prior is +inf at d = -100000",
        "-Abs(d) * exp(100) / b": "in the GPU kernels (float32) the log-prior is nan at d = 0",
        "-log(cosh(d)) - Abs(i) / b": "in the CPU path (float32) the log-prior is -inf",
        "-Abs(d) * sqrt(b - 1)": "b = ",
    }
    for formula, words in cases.items():
        with pytest.raises(SpecError) as err:
            compile_spec(parse_spec(f"name: x\nlog_prior: {formula}\nparams:\n"
                                f"  b: {{init: 4.0, domain: positive}}\n"))
        assert words in str(err.value) and "field 'log_prior'" in str(err.value), str(err.value)


# --------------------------------------------------------------------------------------------
# time bounds

def test_a_cpu_budget_names_the_innermost_field_and_never_extends_an_outer_one():
    import time
    from bamgen.compiler.timeout import cpu_budget, working_on

    def spin(seconds):
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    with pytest.raises(SpecError) as err:
        with cpu_budget("log_prior", "deriving the formula", seconds=0.2):
            with working_on("params.b.init", "checking the init"):
                spin(5)
    assert "field 'params.b.init'" in str(err.value)
    assert "checking the init took more than 0.2 s of CPU time" in str(err.value)
    start = time.process_time()
    with pytest.raises(SpecError):
        with cpu_budget("score", "outer", seconds=0.2):
            with cpu_budget("score", "inner", seconds=30):
                spin(5)
    assert time.process_time() - start < 2


def test_the_build_budget_is_cpu_time_and_can_be_raised(monkeypatch):
    from bamgen.compiler.timeout import stage_cpu_seconds
    monkeypatch.setenv("BAMGEN_BUILD_CPU_SECONDS", "12.5")
    assert stage_cpu_seconds() == 12.5
    monkeypatch.delenv("BAMGEN_BUILD_CPU_SECONDS")
    assert stage_cpu_seconds() == 60.0


@pytest.mark.parametrize("setting", ["nonsense", "-1", "0", "inf"])
def test_a_cpu_budget_that_is_no_number_of_seconds_is_refused_naming_it(tmp_path, monkeypatch,
                                                                          setting):
    """BAMGEN_BUILD_CPU_SECONDS=abc, -1 or 0 were silently ignored (the budget stayed 60 s)."""
    monkeypatch.setenv("BAMGEN_BUILD_CPU_SECONDS", setting)
    write_prior(tmp_path, GOOD)
    res = run_cli_in_process("build", "prior.yaml", "-o", "out", cwd=tmp_path)
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"BAMGEN_BUILD_CPU_SECONDS={setting!r}" in res.stderr.strip().splitlines()[0]
    assert not (tmp_path / "out").exists()


def test_a_stage_out_of_its_cpu_budget_names_the_setting_that_raises_it():
    from bamgen.compiler.timeout import cpu_budget
    with pytest.raises(SpecError, match="BAMGEN_BUILD_CPU_SECONDS=<seconds>"):
        with cpu_budget("score", "spinning", seconds=0.05):
            while True:
                pass


def test_a_prior_over_two_channels_reads_each_and_differentiates_in_each():
    """positions: 2 gives d0, d1, i0, .. (d_c = i_c - j_c): the derivatives in a query's and a
    key's position, channel by channel, with the kink at d_c = 0 read as 0."""
    from bamgen.compiler.symbolic import analyse
    ir = analyse(parse_spec("name: grid\npositions: 2\nlog_prior: -(Abs(d0) + 2*Abs(d1))/b\n"
                            "params:\n  b: {init: 1.0, domain: positive}\n"))
    assert ir.positions_used == ("d0", "d1")
    grads = dict(ir.position_grads)
    assert list(grads) == ["i0", "i1", "j0", "j1"]
    d0, d1, b = sp.Symbol("d0", real=True), sp.Symbol("d1", real=True), sp.Symbol("b", positive=True)
    assert sp.simplify(grads["i1"] - (-2 * sp.sign(d1) / b)) == 0
    assert sp.simplify(grads["j0"] - sp.sign(d0) / b) == 0


def test_a_key_yaml_reads_as_a_boolean_is_named_with_its_line():
    """let: {off: ...} is the key False to YAML: the message gives the line and names the words
    YAML reads so, where it had no line and a hint about "true" alone."""
    text = "name: x\nparams:\n  w: {size: 8, init: 0.0}\nlet:\n  r: Abs(d)\n  off: Min(r, 7)\nlog_prior: w[off]\n"
    with pytest.raises(SpecError) as err:
        parse_spec(text, path="p.yaml")
    message = str(err.value)
    assert message.startswith("p.yaml:6: field 'let.False'"), message
    assert "YAML reads that key as bool" in message and "on, off" in message, message


GREEK = """
name: greek
description: a Gaussian with a linear tail, its parameters named as papers write them
log_prior: -d**2 / (2*σ**2) - λ_*Abs(d)
params:
  σ: {init: 8.0, domain: positive}
  λ_: {init: 0.01, domain: positive}
"""


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_greek_parameter_name_builds_runs_and_learns(tmp_path, backend):
    """σ and λ_ were refused ("use ASCII letters"), though Python takes them as keyword
    arguments: now `attention(q, k, v, σ=..., λ_=...)` runs on both backends (Triton under
    the interpreter here; the kernels' code reads prm_σ), and its output and gradients match a
    float64 reference; the nn.Module stores raw_σ and learns through it."""
    import torch

    import bamgen
    from tests.helpers import write_prior
    from tests.reference import reference_attention
    from tests.tolerance import assert_all_close
    module = bamgen.load(write_prior(tmp_path, GREEK), cache_dir=tmp_path / "cache")
    assert module.PRIOR["params"].keys() == {"σ", "λ_"}
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 24, 16) for _ in range(4))
    values = {"σ": torch.tensor([3.0, 9.0]), "λ_": torch.tensor([0.05, 0.2])}
    leaves = {n: t.clone().requires_grad_(True) for n, t in values.items()}
    out = module.attention(q, k, v, σ=leaves["σ"], λ_=leaves["λ_"], backend=backend)
    out.backward(dout)

    def log_prior(d, p):
        return -d ** 2 / (2 * p["σ"] ** 2) - p["λ_"] * d.abs()
    kw = dict(causal=True, dout=dout)
    ref = reference_attention(q, k, v, values, log_prior, **kw)
    pt = reference_attention(q, k, v, values, log_prior, compute_dtype=torch.float32, **kw)
    assert_all_close([("out", out, ref.out, pt.out)]
                     + [("d" + n, leaves[n].grad, ref.dparams[n], pt.dparams[n]) for n in leaves],
                     torch.float32, context=backend)
    layer = module.GreekAttention(num_heads=2)
    assert set(layer.state_dict()) == {"raw_σ", "raw_λ_"} and set(layer.prior_params()) == {"σ", "λ_"}
    layer(q, k, v, backend=backend).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())


@pytest.mark.parametrize("name, python_reads", [("ﬁ", "fi"), ("µ", "μ"), ("ｂ", "b")])
def test_a_name_python_reads_as_another_is_refused_naming_both(name, python_reads):
    """Python reads an identifier in its NFKC form: a formula's ﬁ (the ligature) is the
    name fi, and so is attention(..., ﬁ=...)'s keyword; a parameter ﬁ could never be reached."""
    with pytest.raises(SpecError) as err:
        parse_spec(f"name: x\nlog_prior: -Abs(d)\nparams:\n  {name}: {{init: 1.0}}\n")
    message = str(err.value)
    assert f"field 'params.{name}'" in message, message
    assert f"'{name}' is read by Python as '{python_reads}'" in message, message
    assert f"write it as {python_reads}" in message


@pytest.mark.parametrize("strategy", ["inline", "table"])
def test_triton_compiles_the_kernels_of_a_greek_parameter_for_a_gpu(tmp_path, strategy):
    """The interpreter runs any Python; the GPU path parses the kernels' code (prm_σ, tab_σ)
    with Triton's own front end: compiled ahead of time for sm_90 (no GPU needed), forward and
    both backward kernels."""
    from tests.helpers import run_cli, run_cli_aot, write_prior
    prior = write_prior(tmp_path, GREEK)
    built = run_cli("build", str(prior), "-o", str(tmp_path), "--strategy", strategy)
    assert built.returncode == 0, built.stderr
    res = run_cli_aot("inspect", str(tmp_path / "greek.py"), "--head-dim", "16",
                      "--kernel", "attn_bwd_dkdv", "--kernel", "attn_bwd_dq")
    assert res.returncode == 0, res.stderr
    assert f"greek: sm_90 bf16 head_dim=16 causal=True layout=plain strategy={strategy}" \
        in res.stdout
    assert all(f"\n  {kernel} " in res.stdout for kernel in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"))


# --------------------------------------------------------------------------------------------
# messages that say how to fix the file


def _refusal(tmp_path, params: str, log_prior: str = "-Abs(d)/b") -> str:
    """`bamgen build`'s one line for a prior file with these params lines (the parameters from
    line 4), FILE for its path, after checking that it is a refusal that wrote nothing; and
    load_spec's message, where that stage refuses it, must be the same."""
    path = write_prior(tmp_path, f"name: x\nlog_prior: \"{log_prior}\"\nparams:\n{params}")
    result = run_cli_in_process("build", str(path), "-o", str(tmp_path / "out"))
    assert result.exit_code == 2 and not (tmp_path / "out").exists(), result.output
    (line,) = result.stderr.splitlines()
    message = line.removeprefix("error: ").replace(str(path), "FILE")
    try:
        load_spec(path)
    except SpecError as exc:
        assert str(exc).replace(str(path), "FILE") == message
    return message


@pytest.mark.parametrize("params, message", [
    ("  b: {init: -1.0, domain: positive}\n",
     "FILE:4: field 'params.b.init': the init -1.0 is outside the domain positive "
     "(hint: give an init inside (0, inf), e.g. init: 1.0)"),
    ("  b: {init: \"1 - 3\", domain: nonnegative}\n",
     "FILE:4: field 'params.b.init': the init -2.0 is outside the domain nonnegative "
     "(hint: give an init inside [0, inf), e.g. init: 1.0)"),
    ("  b: {init: 5, domain: [0, 2]}\n",
     "FILE:4: field 'params.b.init': the init 5.0 is outside the domain (0, 2) "
     "(hint: give an init inside (0, 2), e.g. init: 1)"),
    ("  b: {init: 5, domain: [1, 1.00001]}\n",
     "FILE:4: field 'params.b.init': the init 5.0 is outside the domain (1, 1.00001) "
     "(hint: give an init inside (1, 1.00001), e.g. init: 1.000005)"),
    ("  b: {init: \"exp(100)\", domain: positive}\n",
     "FILE:4: field 'params.b.init': the init gives 2.6881171418161356e+43, beyond float32's "
     "largest value 3.4028235e+38: float32 stores it as inf (hint: give an init inside (0, inf), "
     "e.g. init: 1.0)"),
])
def test_a_constant_init_outside_its_domain_says_which_values_fit(tmp_path, params, message):
    """An init without h or H is one number for every head: the message names no head, and
    the hint gives the domain and a value inside it."""
    assert _refusal(tmp_path, params) == message


def test_an_init_that_reads_the_heads_still_names_the_head(tmp_path):
    message = _refusal(tmp_path, "  b: {init: \"1 - h\", domain: positive}\n")
    assert message == ("FILE:4: field 'params.b.init': the init gives 0.0 for head 1 of 2, "
                       "outside the domain positive (hint: init may use h (head index, "
                       "0-based) and H (number of heads))")


@pytest.mark.parametrize("init, name", [("two", "two"), ("d + 1", "d"), ("2*c", "c")])
def test_an_unknown_name_in_an_init_says_what_an_init_reads(tmp_path, init, name):
    message = _refusal(tmp_path, f"  b: {{init: \"{init}\", domain: positive}}\n  c: 1.0\n")
    assert message.startswith(f"FILE:4: field 'params.b.init': unknown symbol '{name}' (hint: "
                              f"an init reads only numbers (pi and E too), h (head index, "
                              f"0-based) and H (number of heads)"), message
    assert "declare parameters" not in message


@pytest.mark.parametrize("params, line", [
    ("  b: {inti: 1.0, domain: positive}\n", 4),
    ("  b:\n    init: 1.0\n    domian: positive\n", 6),
    ("  c: 1.0\n  b:\n    true: 1.0\n", 5),      # a key YAML reads as a boolean: its parameter's line
])
def test_a_typo_in_a_parameter_setting_names_its_line(tmp_path, params, line):
    message = _refusal(tmp_path, params)
    assert re.match(rf"FILE:{line}: field 'params\.b\.(inti|domian|True)': unknown field .* in "
                    rf"parameter 'b' \(hint: allowed fields: init, domain", message), message


@pytest.mark.parametrize("log_prior, rewrite", [
    ("-r*log1p(b*Abs(d))", "write log1p(b*Abs(d)) as log(1 + b*Abs(d))"),
    ("log(sigmoid((b - Abs(d))/r))", "write sigmoid((b - Abs(d))/r) as (1 + tanh(((b - Abs(d))/r)/2))/2"),
    ("-softplus(Abs(d) - b)", "write softplus(Abs(d) - b) as log(1 + exp(Abs(d) - b))"),
    ("-relu(Abs(d) - b)", "write relu(Abs(d) - b) as Max(Abs(d) - b, 0)"),
    ("-abs(d)/b", "write abs(d) as Abs(d)"),
    ("-max(Abs(d), b, r)", "write max(Abs(d), b, r) as Max(Abs(d), b, r)"),
    ("-clamp(Abs(d), 0, b)", "write clamp(Abs(d), 0, b) as Min(Max(Abs(d), 0), b)"),
    ("-clip(Abs(d))", "write clip(x, lo, hi) as Min(Max(x, lo), hi)"),
    ("-log2(1 + Abs(d))", "write log2(1 + Abs(d)) as log(1 + Abs(d))/log(2)"),
    ("-expm1(-b)*Abs(d)", "write expm1(-b) as exp(-b) - 1"),
])
def test_an_unknown_function_with_an_obvious_rewrite_gets_it_in_the_hint(tmp_path, log_prior, rewrite):
    params = "  b: {init: 1.0, domain: positive}\n  r: {init: 1.0, domain: positive}\n"
    message = _refusal(tmp_path, params, log_prior)
    name = rewrite.split()[1].partition("(")[0]
    assert message.startswith(f"FILE:2: field 'log_prior': unknown function '{name}' "
                              f"(hint: {rewrite}; allowed functions: Abs, Max"), message


@pytest.mark.parametrize("outer,call,bias", [
    ("-3*{}", "sigmoid(-Abs(d)*b)", lambda d: -3 * torch.sigmoid(-d.abs())),
    ("{}", "sigmoid(d/b)", lambda d: torch.sigmoid(d)),
    ("log({})", "sigmoid((b - Abs(d))/r)", lambda d: torch.nn.functional.logsigmoid(1 - d.abs())),
])
def test_the_sigmoid_hint_builds_and_computes_the_sigmoid(tmp_path, outer, call, bias):
    """The hint's sigmoid, written as 1/(1 + exp(-x)), was refused by the build outside a log
    (exp overflows far out, its derivative in b nan); its tanh form builds, in a log too, and
    the module's logits carry the sigmoid (b = r = 1, against torch's, non-causal)."""
    import bamgen
    params = "  b: {init: 1.0, domain: positive}\n  r: {init: 1.0, domain: positive}\n"
    rewritten = re.search(r"as (.*); allowed", _refusal(tmp_path, params, outer.format(call))).group(1)
    path = tmp_path / "rewritten.yaml"
    path.write_text(f"name: rewritten\nlog_prior: \"{outer.format('(' + rewritten + ')')}\"\n"
                    f"params:\n{params}")
    module = bamgen.load(path, cache_dir=tmp_path / "cache")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    values = {name: 1.0 for name in module.PARAM_NAMES}
    d = (torch.arange(9.0)[:, None] - torch.arange(9.0)[None]).double()
    want = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5 + bias(d), -1) @ v
    got = module.attention(q, k, v, causal=False, backend="torch", **values)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_an_unknown_function_without_a_rewrite_gets_the_list():
    with pytest.raises(SpecError, match=r"unknown function 'gamma' \(hint: allowed functions: Abs"):
        parse_formula("gamma(d)", SYMS, field="log_prior")


REFERENCE = {
    "log1p": math.log1p, "expm1": math.expm1, "log2": math.log2, "log10": math.log10,
    "ln": math.log, "exp2": lambda x: 2 ** x, "sigmoid": lambda x: 1 / (1 + math.exp(-x)),
    "softplus": lambda x: math.log1p(math.exp(x)), "relu": lambda x: max(x, 0.0),
    "abs": abs, "fabs": abs, "max": max, "min": min,
    "clip": lambda x, lo, hi: min(max(x, lo), hi), "clamp": lambda x, lo, hi: min(max(x, lo), hi),
    "ceil": math.ceil, "sgn": lambda x: math.copysign(1.0, x), "arctan": math.atan,
    "erfc": math.erfc, "rsqrt": lambda x: 1 / math.sqrt(x), "tan": math.tan,
    "square": lambda x: x * x, "pow": math.pow,
}


@pytest.mark.parametrize("name", sorted(REWRITES))
def test_every_rewrite_a_hint_gives_is_a_formula_of_the_language_computing_the_function(name):
    """The hint's formula, with arguments that are themselves expressions, parses and gives
    what the function gives."""
    arguments = ("d - 0.7", "d*d + 1.5", "d + 3")[:len(REWRITES[name][0])]
    call = f"{name}({', '.join(arguments)})"
    with pytest.raises(SpecError) as err:
        parse_formula(call, SYMS, field="log_prior")
    rewritten = re.search(rf"write {re.escape(call)} as (.*); allowed", str(err.value)).group(1)
    expr = parse_formula(rewritten, SYMS, field="log_prior")
    compared = 0
    for x in (0.2, 1.3, 2.9):
        values = [eval(a, {"d": x}) for a in arguments]
        try:
            want = REFERENCE[name](*values)
        except ValueError:    # outside the function's domain (log of -0.5): nothing to compare
            continue
        assert float(expr.subs(D, x)) == pytest.approx(want, rel=1e-12), rewritten
        compared += 1
    assert compared >= 2


@pytest.mark.parametrize("positions, index, integers, reals", [
    (1, "d/8", "d, i, j, n, ", None),
    (2, "d0", "n, ", "d0, d1, i0, i1, j0, j1"),
    (3, "(d0 + i1*2)/3", "n, ", "d0, d1, d2, i0, i1, i2, j0, j1, j2"),
])
def test_an_index_that_is_not_an_integer_is_refused_in_the_priors_own_symbols(
        tmp_path, positions, index, integers, reals):
    """The hint lists the integer positions this prior has (over several channels n alone: d,
    i and j are not its symbols) and its real ones, and writes the index under floor() as the
    file spells it; the file so fixed builds. It listed d, i, j, n to a prior over channels."""
    text = "name: x\npositions: {}\nlog_prior: w[{}]\nparams:\n  w: {{size: 8, init: 0.0}}\n"
    path = write_prior(tmp_path, text.format(positions, index))
    result = run_cli_in_process("build", str(path), "-o", str(tmp_path / "out"))
    assert result.exit_code == 2 and not (tmp_path / "out").exists(), result.output
    (line,) = result.stderr.splitlines()
    assert "is not integer-valued (hint: an index is an integer, " + integers + "a Sum's index" \
        in line, line
    real_part = f"; this prior's positions {reals} are real numbers" if reals else ""
    assert line.endswith(f"of those{real_part}: e.g. w[floor({index})])"), line
    fixed = write_prior(tmp_path, text.format(positions, f"floor({index})"), "fixed.yaml")
    result = run_cli_in_process("build", str(fixed), "-o", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output


LAMBDA, IN = sp.Symbol("lambda", positive=True), sp.Symbol("in", real=True)
KEYWORD_SYMS = {"d": D, "lambda": LAMBDA, "in": IN}


@pytest.mark.parametrize("formula, expected", [
    ("exp(-lambda*Abs(d))", sp.exp(-LAMBDA * sp.Abs(D))),
    ("-lambda*Abs(d) - in", -LAMBDA * sp.Abs(D) - IN),
    ("-(lambda\n   * Abs(d))", -LAMBDA * sp.Abs(D)),
    # and, or stay the language's operators beside a parameter named by a keyword
    ("Piecewise((-lambda*d, (d > 0) and (d < in)), (0, True))",
     sp.Piecewise((-LAMBDA * D, sp.And(D > 0, D < IN)), (0, True))),
    # an undeclared keyword is a Sum's index as any new name is
    ("Sum(d*for, (for, 0, 3))", 6 * D),
])
def test_a_python_keyword_declared_as_a_name_reads_as_that_name(formula, expected):
    assert parse_formula(formula, KEYWORD_SYMS, field="log_prior") == expected


@pytest.mark.parametrize("formula, symbols, words", [
    ("exp(-lambda*d)", {"d": D}, "unknown symbol 'lambda'"),
    ("log1p(lambda*d)", KEYWORD_SYMS, "write log1p(lambda*d) as log(1 + lambda*d)"),
    ("w[lambda]", KEYWORD_SYMS, "e.g. w[floor(lambda)]"),
    ("lambda d: -d", {"d": D}, "a lambda is not allowed"),
    ("-lambda*(d", KEYWORD_SYMS, "cannot parse '-lambda*(d'"),
])
def test_messages_about_a_keyword_name_spell_it_as_written(formula, symbols, words):
    """The parser reads lambda under another name; no message shows that name."""
    vectors = {"w": tuple(ElementSymbol("w", k) for k in range(4))}
    with pytest.raises(SpecError) as err:
        parse_formula(formula, symbols, field="log_prior", vectors=vectors)
    assert words in str(err.value) and "keyword_" not in str(err.value), str(err.value)


KEYWORDS = """
name: decay
description: an exponential decay at rate lambda, a log term weighted by in, a buffer global
log_prior: -rate_d - in*log(1 + Abs(d)) - global*with[Min(floor(Abs(d)/4), 3)]
let:
  rate_d: lambda*Abs(d)
params:
  lambda: {init: 0.5, domain: positive}
  in: {init: 0.1}
  global: {init: 1.0, learnable: false}
  with: {size: 4, init: 0.25, per_head: false, learnable: false}
"""


def _keyword_log_prior(d, p):
    table = p["with"]   # [B, Hq, Nq, Nk, 4]
    bucket = torch.clamp(torch.floor(d.abs() / 4), max=3).long().expand(table.shape[:-1])
    element = torch.gather(table, -1, bucket[..., None])[..., 0]
    return -p["lambda"] * d.abs() - p["in"] * torch.log(1 + d.abs()) - p["global"] * element


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_prior_with_python_keywords_as_names_builds_runs_and_learns(tmp_path, backend):
    """lambda (a decay rate), in and global were refused as Python keywords; now the CLI builds
    the prior, attention() takes them as **{"lambda": ...} on both backends (Triton under the
    interpreter) and matches a float64 reference with the gradient of lambda, the nn.Module
    stores them under the user's names and round-trips its state dict."""
    from bamgen.driver.loader import import_module_file
    from tests.reference import reference_attention
    from tests.tolerance import assert_all_close
    prior = write_prior(tmp_path, KEYWORDS, "decay.yaml")
    res = run_cli_in_process("build", str(prior), "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert res.exit_code == 0, res.output
    module = import_module_file(tmp_path / "out" / "decay.py")
    assert module.PARAM_NAMES == ("lambda", "in", "global", "with")
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 24, 16) for _ in range(4))
    values = {"lambda": torch.tensor([0.05, 0.3]), "in": torch.tensor([0.5, -0.2]),
              "global": torch.tensor([1.0, 2.0]), "with": torch.tensor([0.0, 0.5, 1.0, 3.0])}
    leaves = {n: t.clone().requires_grad_(n in module.LEARNABLE) for n, t in values.items()}
    out = module.attention(q, k, v, **leaves, backend=backend)
    out.backward(dout)
    kw = dict(causal=True, dout=dout)
    values["with"] = values["with"][None]   # (the reference's shape of a shared vector)
    ref = reference_attention(q, k, v, values, _keyword_log_prior, **kw)
    pt = reference_attention(q, k, v, values, _keyword_log_prior, compute_dtype=torch.float32, **kw)
    assert_all_close([("out", out, ref.out, pt.out)]
                     + [("d" + n, leaves[n].grad, ref.dparams[n], pt.dparams[n])
                        for n in ("lambda", "in")], torch.float32, context=backend)
    layer = module.DecayAttention(num_heads=2, init={"lambda": [0.05, 0.3]})
    assert set(layer.state_dict()) == {"raw_lambda", "raw_in", "global", "with"}
    assert torch.equal(getattr(layer, "with"), torch.full((4,), 0.25))
    layer(q, k, v, backend=backend).sum().backward()
    assert getattr(layer, "raw_lambda").grad.abs().min() > 0
    again = module.DecayAttention(num_heads=2)
    again.load_state_dict(layer.state_dict())
    assert torch.equal(again(q, k, v, backend=backend), layer(q, k, v, backend=backend))
    torch.testing.assert_close(again.prior_params()["lambda"], torch.tensor([0.05, 0.3]))


def test_errors_about_a_keyword_parameter_name_it_as_written(tmp_path):
    from bamgen.driver.loader import import_module_file
    bad = write_prior(tmp_path, KEYWORDS.replace("{init: 0.5, domain: positive}",
                                                 "{init: -0.5, domain: positive}"), "bad.yaml")
    res = run_cli_in_process("build", str(bad), "-o", str(tmp_path / "bad"), cwd=tmp_path)
    assert res.exit_code == 2 and "field 'params.lambda.init'" in res.output, res.output
    prior = write_prior(tmp_path, KEYWORDS, "decay.yaml")
    assert run_cli_in_process("build", str(prior), "-o", str(tmp_path / "out"),
                              cwd=tmp_path).exit_code == 0
    module = import_module_file(tmp_path / "out" / "decay.py")
    q = k = v = torch.randn(1, 2, 8, 16)
    given = {"in": 0.1, "global": 1.0, "with": torch.zeros(4)}
    with pytest.raises(TypeError, match=r"""attention\(\) missing 1 required keyword-only """
                                        r"""argument: 'lambda' .*\*\*\{'lambda': value\}"""):
        module.attention(q, k, v, **given)
    with pytest.raises(TypeError, match=r"attention\(\) got an unexpected keyword argument 'lamda'"):
        module.attention(q, k, v, **given, **{"lambda": 0.5, "lamda": 0.5})
    with pytest.raises(ValueError, match="lambda must be positive"):
        module.attention(q, k, v, **given, **{"lambda": -0.5})
    with pytest.raises(ValueError, match="init: lambda must be positive"):
        module.DecayAttention(num_heads=2, init={"lambda": -1.0})


def test_a_number_yaml_reads_as_a_string_is_a_number_in_every_numeric_field():
    """YAML 1.1 reads 1e-3 (no dot) as a string: init took it, while value, skip_below and a
    domain's bounds refused it as 'not a number'."""
    spec = parse_spec("""
name: e_numbers
log_prior: -Abs(d) / b - c * d**2
skip_below: 1e2
params:
  b: {init: 1e-3, domain: [0, 1e3]}
  c: {value: 1e-3, domain: positive}
""")
    b, c = spec.params
    assert spec.skip_below == 100.0
    assert (b.domain.lo, b.domain.hi) == (0.0, 1000.0)
    assert c.value == 0.001


@pytest.mark.parametrize("field, text", [("params.c.value", "c: {value: 'abc'}"),
                                         ("params.c.domain", "c: {init: 1.0, domain: [0, nan]}")])
def test_a_string_that_spells_no_finite_number_is_still_refused(field, text):
    with pytest.raises(SpecError, match=re.escape(field)):
        parse_spec(f"name: x\nlog_prior: -Abs(d) * c\nparams:\n  {text}\n")


@pytest.mark.parametrize("text, field, words", [
    ("name: x\nlog_prior: -Abs(d)/b\nparams:\n  5: {init: 1.0}\n", "params.5",
     ("YAML reads that key as int", "starts with a letter")),
    ("name: x\nlog_prior: -Abs(d)/b\nparams:\n  b: {init: 1e400}\n", "params.b.init",
     ("beyond the largest float", "reads it as inf")),
    ("name: x\nlog_prior: -Abs(d)/b\nparams:\n  b: {init: 1.0e400}\n", "params.b.init",
     ("beyond the largest float", "reads it as inf")),
    ("name:\nlog_prior: -Abs(d)\n", "name", ("name: is empty", "remove the line")),
])
def test_messages_say_what_yaml_read_and_how_to_fix_it(text, field, words):
    """A key 5 got a hint about yes/no/on/off; init 1e400 said only 'the number inf is not
    finite'; an empty name: said 'invalid name None'."""
    with pytest.raises(SpecError) as caught:
        parse_spec(text, path="p.yaml")
    assert caught.value.field == field
    for word in words:
        assert word in str(caught.value), str(caught.value)
    assert "yes, no, on, off" not in str(caught.value)
