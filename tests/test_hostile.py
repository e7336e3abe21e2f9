"""Hostile and broken prior files (tests/hostile/) through the real command line.

Every file must be refused by ``python -m bamgen.cli build FILE -o OUT`` in a fresh interpreter:
exit status 2 within LIMIT_S seconds, exactly one line on stderr that names the file, the field
(where one applies) and what is wrong, no traceback, nothing written (OUT is not created; or, for
every other file, OUT already holds the module the file names and it stays byte for byte as it
was), and nothing run: the injection files try ``touch PWNED`` and the CLI runs with its working
folder in a temporary directory that must end as it began.

The files run in a thread pool (each in its own subprocess) once per session; each file is then
its own test case.
"""
from __future__ import annotations

import concurrent.futures
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import run_cli, write_prior

HOSTILE = Path(__file__).resolve().parent / "hostile"
LIMIT_S = 20            # wall seconds per file, interpreter start included
WORKERS = 3
SENTINEL = "# an earlier output of the prior 'hostile'; a refused build must leave it alone\n"

# file -> (the field the message names, or None where no single field applies;
#          words the message must contain)
EXPECTED: dict[str, tuple[str | None, tuple[str, ...]]] = {
    # code injection through every string field
    "inject_name.yaml": ("name", ("invalid name",)),
    "inject_description.yaml": ("description", ('contains \'"""\'', "docstring")),
    "inject_source.yaml": ("source", ('contains \'"""\'', "docstring")),
    "inject_log_prior.yaml": ("log_prior", ("attribute access cannot be called",)),
    "inject_density.yaml": ("density", ("unknown function 'eval'",)),
    "inject_score.yaml": ("score", ("unknown function 'exec'",)),
    "inject_init.yaml": ("params.b.init", ("attribute access cannot be called",)),
    "inject_domain.yaml": ("params.b.domain", ("invalid domain",)),
    "inject_value.yaml": ("params.b.value", ("is not a number",)),
    "inject_formula_comment.yaml": ("log_prior", ("comments ('#')",)),
    # the formula whitelist
    "dunder_bases.yaml": ("log_prior", ("attribute access cannot be called",)),
    "dunder_attribute.yaml": ("log_prior", ("attribute access is not allowed",)),
    "lambda.yaml": ("log_prior", ("a lambda is not allowed",)),
    "comprehension.yaml": ("log_prior", ("a comprehension is not allowed",)),
    "generator.yaml": ("log_prior", ("a generator is not allowed",)),
    "fstring.yaml": ("log_prior", ("an f-string is not allowed",)),
    "walrus.yaml": ("log_prior", ("':=' is not allowed",)),
    "subscript.yaml": ("log_prior", ("indexing is not allowed",)),
    "starred.yaml": ("log_prior", ("unpacking is not allowed",)),
    "keyword_argument.yaml": ("log_prior", ("keyword arguments are not allowed",)),
    "unknown_symbol.yaml": ("log_prior", ("unknown symbol 'x'",)),
    "unknown_function.yaml": ("log_prior", ("unknown function 'gamma'",)),
    "underscore_symbol.yaml": ("log_prior", ("may not start with '_'",)),
    "syntax_warning.yaml": ("log_prior", ("a constant cannot be called",)),
    "control_characters.yaml": ("log_prior", ("cannot parse", "\\x1b")),
    # sizes: constants, powers, nesting, length
    "power_9_9_9.yaml": ("log_prior", ("exponent 387420489 is too large",)),
    "power_10_10_10.yaml": ("log_prior", ("exponent 10000000000 is too large",)),
    "power_d_1e9.yaml": ("log_prior", ("is too large (limit 1000)",)),
    "power_nested_sum.yaml": ("log_prior", ("multiply to degree",)),
    "power_tower.yaml": ("log_prior", ("cannot be computed", "non-constant exponent overflows")),
    "exp_tower_negated.yaml": ("log_prior", ("cannot be computed", "exp() of a value that overflows")),
    "tanh_of_overflow.yaml": ("log_prior", ("cannot be computed", "tanh() of a value that overflows")),
    "floor_of_huge_constant.yaml": ("log_prior", ("the constant", "overflows a float")),
    "constant_overflow.yaml": ("log_prior", ("the constant exp(1000) overflows a float",)),
    "deep_unary_minus.yaml": ("log_prior", ("nested deeper than 32 levels",)),
    "deep_calls.yaml": ("log_prior", ("nested deeper than 32 levels",)),
    "long_formula.yaml": ("log_prior", ("characters long; the limit is 2000",)),
    "huge_integer.yaml": (None, ("not valid YAML", "cannot be read")),
    # shadowed and malformed names
    "shadow_exp.yaml": ("params.exp", ("'exp' is reserved",)),
    "shadow_d.yaml": ("params.d", ("'d' is reserved",)),
    "shadow_s.yaml": ("params.s", ("'s' is reserved",)),
    "shadow_log_prior.yaml": ("params.log_prior", ("'log_prior' is reserved",)),
    "shadow_h.yaml": ("params.h", ("'h' is reserved",)),
    "shadow_piecewise.yaml": ("params.Piecewise", ("'Piecewise' is reserved",)),
    "shadow_lambda.yaml": ("params.lambda", ("'lambda' is reserved",)),
    "shadow_q.yaml": ("params.q", ("'q' is reserved",)),
    "param_underscore.yaml": ("params._b", ("invalid parameter name '_b'",)),
    "param_newline.yaml": ("params.b\\n", ("invalid parameter name",)),
    "name_traversal.yaml": ("name", ("invalid name '../../etc/passwd'",)),
    "name_absolute.yaml": ("name", ("invalid name '/tmp/x'",)),
    "name_slash.yaml": ("name", ("invalid name 'a/b'",)),
    "name_uppercase.yaml": ("name", ("invalid name 'MyPrior'",)),
    "name_dash.yaml": ("name", ("invalid name 'my-prior'",)),
    "name_newline.yaml": ("name", ("invalid name 'hostile\\n'",)),
    "description_backslash.yaml": ("description", ("contains a backslash",)),
    # values that are not finite
    "divide_by_zero.yaml": ("log_prior", ("not finite",)),
    "log_of_zero.yaml": ("log_prior", ("not finite",)),
    "density_zero.yaml": ("density", ("not finite",)),
    "log_prior_oo.yaml": ("log_prior", ("not finite",)),
    "logit_not_finite_at_init.yaml": ("log_prior", ("not finite at the initial parameters",)),
    "score_without_s.yaml": ("score", ("does not use s",)),
    # parameters
    "init_negative.yaml": ("params.b.init", ("gives -1.0", "outside the domain positive")),
    "init_uses_d.yaml": ("params.b.init", ("unknown symbol 'd'",)),
    "init_overflow.yaml": ("params.b.init", ("cannot be computed", "overflows a float")),
    "init_nan.yaml": ("params.b.init", ("gives nan", "outside the domain")),
    "domain_reversed.yaml": ("params.b.domain", ("invalid domain [2, 1]",)),
    "domain_symbols.yaml": ("params.b.domain", ("invalid domain ['a', 'b']",)),
    "domain_complex.yaml": ("params.b.domain", ("invalid domain 'complex'",)),
    "learnable_yes.yaml": ("params.b.learnable", ("expected true or false, got 'yes'",)),
    "value_outside_domain.yaml": ("params.b.value", ("-1 is not a number in the domain positive",)),
    "value_with_init.yaml": ("params.b.value", ("either 'value'",)),
    "value_huge.yaml": ("params.b.value", ("larger than 1e+12",)),
    "params_not_mapping.yaml": ("params", ("must be a mapping",)),
    # YAML
    "yaml_tag_apply.yaml": (None, ("not valid YAML", "python/object/apply:os.system")),
    "yaml_tag_name.yaml": (None, ("not valid YAML", "python/name:os.system")),
    "yaml_tag_binary.yaml": ("log_prior", ("got bytes",)),
    "yaml_bad_date.yaml": (None, ("not valid YAML", "day is out of range")),
    "billion_laughs_name.yaml": ("name", ("invalid name",)),
    "duplicate_key.yaml": ("log_prior", ("given twice",)),
    "duplicate_param_key.yaml": ("params.b.init", ("given twice",)),
    "deep_yaml.yaml": (None, ("not valid YAML", "nested too deeply")),
    "bad_yaml.yaml": (None, ("not valid YAML",)),
    "top_level_list.yaml": (None, ("must be a YAML mapping",)),
    "empty.yaml": (None, ("the file is empty",)),
    "whitespace_only.yaml": (None, ("the file is empty",)),
    "huge_file.yaml": (None, ("bytes; the limit is 65536",)),
    # bytes
    "binary_garbage.yaml": (None, ("not UTF-8",)),
    "utf16.yaml": (None, ("not UTF-8",)),
    "nul_byte.yaml": (None, ("NUL bytes",)),
    "nul_in_formula.yaml": ("log_prior", ("NUL byte",)),
}


@dataclass
class Run:
    path: Path
    workdir: Path
    out: Path
    had_output: bool
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    before: dict
    after: dict


def _snapshot(folder: Path) -> dict:
    """Every file under ``folder``: content and modification time."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _refuse(path: Path, workdir: Path, had_output: bool) -> Run:
    out = workdir / "out"
    if had_output:
        out.mkdir()
        (out / "hostile.py").write_text(SENTINEL)
    before = _snapshot(workdir)
    start = time.monotonic()
    res = run_cli("build", str(path), "-o", str(out), cwd=workdir)
    seconds = time.monotonic() - start
    return Run(path, workdir, out, had_output, res.returncode, res.stdout, res.stderr, seconds,
               before, _snapshot(workdir))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    names = sorted(EXPECTED)
    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        futures = {name: pool.submit(_refuse, HOSTILE / name, tmp_path_factory.mktemp("hostile"),
                                     k % 2 == 1)
                   for k, name in enumerate(names)}
        return {name: f.result() for name, f in futures.items()}


def test_every_hostile_file_has_an_expectation():
    on_disk = {p.name for p in HOSTILE.iterdir()}
    assert on_disk == set(EXPECTED)
    assert len(on_disk) >= 30


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hostile_file_is_refused_cleanly(runs, name):
    run = runs[name]
    field, words = EXPECTED[name]
    assert "Traceback" not in run.stderr + run.stdout, run.stderr
    assert run.returncode == 2, run.stderr
    assert run.seconds < LIMIT_S, f"{name} took {run.seconds:.1f} s"
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    line = lines[0]
    assert line.startswith("error: ") and str(run.path) in line, line
    if field is None:
        assert "field '" not in line, line
    else:
        assert f"field '{field}':" in line, line
    for word in words:
        assert word in line, line
    assert run.stdout == ""
    # nothing written, nothing run: the working folder is as it was, byte for byte
    assert not (run.workdir / "PWNED").exists()
    assert run.after == run.before
    if run.had_output:
        assert (run.out / "hostile.py").read_text() == SENTINEL
    else:
        assert not run.out.exists()


GOOD = """
name: hostile
log_prior: -Abs(d) / b
params:
  b: {init: 4.0, domain: positive}
"""


@pytest.mark.parametrize("filename", [
    'x\nimport os; os.system("touch PWNED")\n#.yaml',      # would start a line of the header
    'x"""; __import__("os").system("touch PWNED"); """.yaml',   # would close the docstring
])
def test_a_hostile_file_name_is_refused(tmp_path, filename):
    prior = write_prior(tmp_path, GOOD, filename)
    res = run_cli("build", str(prior), "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and "the file name contains" in lines[0], res.stderr
    assert sorted(os.listdir(tmp_path)) == [filename]


def test_late_refusals_leave_a_built_module_of_the_same_name_untouched(tmp_path):
    """Each bad file names the module an earlier build wrote, and fails only in the maths."""
    out = tmp_path / "out"
    good = write_prior(tmp_path, GOOD, "good.yaml")
    assert run_cli("build", str(good), "-o", str(out), cwd=tmp_path).returncode == 0
    before = _snapshot(out)
    assert list(before) == ["hostile.py"]
    for name in ("logit_not_finite_at_init.yaml", "exp_tower_negated.yaml", "constant_overflow.yaml"):
        res = run_cli("build", str(HOSTILE / name), "-o", str(out), cwd=tmp_path)
        assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
        assert _snapshot(out) == before, name


def test_init_in_the_head_index_alone_builds(tmp_path):
    """`init: h` used to crash the init check (a SymPy symbol replaced by a plain int)."""
    prior = write_prior(tmp_path, """
        name: by_head
        log_prior: -Abs(d) / (a + 1) - c * Abs(d)
        params:
          a: {init: h, domain: nonnegative}
          c: {init: "1/H", domain: positive}
        """)
    res = run_cli("build", str(prior), "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out" / "by_head.py").is_file()
