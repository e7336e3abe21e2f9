"""Stage 1: prior files to PriorSpec, and the formula whitelist."""
import pytest
import sympy as sp

from bamgen.errors import SpecError
from bamgen.formula import parse_formula
from bamgen.spec import parse_spec

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
    ("_secret", "may not start with '_'"),
    ("9**9**9", "too large"),
    ("d ** 100000", "too large"),
    ("1" + "0" * 20, "larger than"),
    ("-" * 40 + "d", "nested deeper"),
    ("d < 3", "condition was used"),
    ("exp(d, d)", "takes 1 argument"),
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
])
def test_bad_files_name_the_field(text, field, words):
    with pytest.raises(SpecError) as err:
        spec = parse_spec(text)
        # some errors surface when the mathematics is built
        from bamgen.symbolic import analyse
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
