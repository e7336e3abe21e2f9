"""Hostile, broken and tricky prior files (tests/compiler/hostile/) through the command line.

Every file in the corpus either

* is refused (EXPECTED): exit status 2 within LIMIT_S seconds, exactly one line on stderr that
  names the file, the field (where one applies) and what is wrong, no traceback, nothing
  written (OUT is not created; or, for every other file, OUT already holds the module the file
  names and it stays byte for byte as it was), and nothing run: the injection files try
  ``touch PWNED`` and the CLI runs with its working folder in a temporary directory that must
  end as it began; or
* builds (BUILDS) within LIMIT_S seconds into a module whose output and every gradient match
  the float64 reference of tests/reference.py on the torch and the Triton path.

The corpus runs in this process through click's test runner: the CLI's own code (its time
limit, its one-line messages, its exit codes) without an interpreter start per file. The few
tests that need a real process boundary (a file name with a newline, a FIFO, a link to
/dev/zero) run ``python -m bamgen.cli``.
"""
from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from bamgen.driver.loader import import_module_file
from tests.helpers import run_cli, run_cli_in_process, write_prior
from tests.reference import reference_attention
from tests.tolerance import assert_all_close

HOSTILE = Path(__file__).resolve().parent / "hostile"
LIMIT_S = 10            # seconds per file (in this process: no interpreter start)
SUBPROCESS_LIMIT_S = 20  # with an interpreter start and torch's import
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
    "subscript.yaml": ("log_prior", ("indexing is allowed on vector parameters only, not on 'd'",)),
    "starred.yaml": ("log_prior", ("unpacking is not allowed",)),
    "keyword_argument.yaml": ("log_prior", ("keyword arguments are not allowed",)),
    "unknown_symbol.yaml": ("log_prior", ("unknown symbol 'x'",)),
    "unknown_function.yaml": ("log_prior", ("unknown function 'gamma'",)),
    "unknown_function_log1p.yaml": ("log_prior", ("unknown function 'log1p'", "hint: write "
                                                  "log1p(r2*Abs(d)) as log(1 + r2*Abs(d));")),
    "unknown_function_sigmoid.yaml": ("log_prior", ("unknown function 'sigmoid'", "hint: write "
                                                    "sigmoid((W - Abs(d))/t) as "
                                                    "(1 + tanh(((W - Abs(d))/t)/2))/2;")),
    "underscore_symbol.yaml": ("log_prior", ("unknown symbol '_b'",)),
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
    "shadow_q.yaml": ("params.q", ("'q' is reserved", "attention()")),
    "param_newline.yaml": ("params.b\\n", ("invalid parameter name",)),
    "name_traversal.yaml": ("name", ("invalid name '../../etc/passwd'",)),
    "name_absolute.yaml": ("name", ("invalid name '/tmp/x'",)),
    "name_slash.yaml": ("name", ("invalid name 'a/b'",)),
    "name_uppercase.yaml": ("name", ("invalid name 'MyPrior'",)),
    "name_dash.yaml": ("name", ("invalid name 'my-prior'",)),
    "name_newline.yaml": ("name", ("invalid name 'hostile\\n'",)),
    "description_backslash.yaml": ("description", ("contains a backslash",)),
    # names that cannot be a parameter's: the language's, and attention()'s arguments
    "shadow_key_mask.yaml": ("params.key_mask", ("'key_mask' is reserved", "attention()")),
    "name_torch.yaml": ("name", ("'torch' would hide the module 'torch'",)),
    "name_triton.yaml": ("name", ("'triton' would hide the module 'triton'",)),
    "name_stdlib_json.yaml": ("name", ("'json' would hide the module 'json'",)),
    # values that are not finite, at the check points or anywhere in the domain
    "divide_by_zero.yaml": ("log_prior", ("not finite",)),
    "log_of_zero.yaml": ("log_prior", ("the prior is zero (log-prior -oo) at every position",)),
    "density_zero.yaml": ("density", ("not finite",)),
    "log_prior_oo.yaml": ("log_prior", ("not finite",)),
    "logit_not_finite_at_init.yaml": ("log_prior", ("the log-prior is nan at d = 0", "b = 0")),
    "score_without_s.yaml": ("score", ("does not use s",)),
    "pole_between_check_points.yaml": ("log_prior", ("the log-prior is +inf at d = 10",)),
    "pole_far_away.yaml": ("log_prior", ("the log-prior is +inf at d = 100000",)),
    "pole_at_parameter.yaml": ("log_prior", ("the log-prior is +inf", "mu = ")),
    "complex_branch_far.yaml": ("log_prior", ("the log-prior is nan at d = ",)),
    "complex_branch_in_piecewise.yaml": ("log_prior", ("the log-prior is nan at d = 101",)),
    "complex_for_some_parameters.yaml": ("log_prior", ("the log-prior is nan", "b = 0.01")),
    "positive_infinity.yaml": ("log_prior", ("the log-prior is +inf at d = 0",)),
    "zero_everywhere.yaml": ("log_prior", ("the prior is zero", "every position")),
    "score_not_real.yaml": ("score", ("the logit is nan or +inf",)),
    "constant_float32_overflow.yaml": ("log_prior", ("in the GPU kernels (float32)",
                                                     "is nan at d = 0", "where its value is -0")),
    "constant_comparison.yaml": ("log_prior", ("cannot be decided in floating point",)),
    # a constant index outside its vector (a computed one is clamped: docs/priors.md)
    "vector_index_negative.yaml": ("log_prior", ("the index of w[-1] is outside its 9 elements",
                                                 "w[8] is the last element")),
    "vector_index_past_end.yaml": ("log_prior", ("the index of w[40] is outside its 9 elements",)),
    "sum_past_vector_end.yaml": ("log_prior", ("the Sum reads element 9 of a vector of 9 at m = 8",)),
    # parameters
    "yaml_key_true.yaml": ("params.True", ("invalid parameter name True: YAML reads that key as bool",
                                           "quote it")),
    "init_negative.yaml": ("params.b.init", ("the init -1.0 is outside the domain positive",
                                             "hint: give an init inside (0, inf), e.g. init: 1.0")),
    "init_uses_d.yaml": ("params.b.init", ("unknown symbol 'd'", "an init reads only numbers")),
    "init_unknown_word.yaml": ("params.b.init", ("unknown symbol 'two'", "hint: an init reads "
                                                 "only numbers (pi and E too), h (head index")),
    "param_setting_typo.yaml": ("params.b.inti", ("param_setting_typo.yaml:7: field",
                                                  "unknown field 'inti' in parameter 'b'")),
    "init_overflow.yaml": ("params.b.init", ("cannot be computed", "overflows a float")),
    "init_nan.yaml": ("params.b.init", ("the init nan is outside the domain positive",)),
    "init_negative_for_many_heads.yaml": ("params.b.init", ("for head 100 of 101",
                                                            "outside the domain positive")),
    "init_underflows_float32.yaml": ("params.b.init", ("gives 1e-50", "smallest normal")),
    "init_denormal_float32.yaml": ("params.b.init", ("gives 1e-40", "smallest normal")),
    "init_overflows_float32.yaml": ("params.b.init", ("largest value 3.4028235e+38",)),
    "init_pole_at_head_count.yaml": ("params.b.init", ("gives inf for head 0 of 100",)),
    "init_floor_of_huge.yaml": ("params.b.init", ("largest value 3.4028235e+38",)),
    "domain_reversed.yaml": ("params.b.domain", ("invalid domain [2, 1]",)),
    "domain_symbols.yaml": ("params.b.domain", ("invalid domain ['a', 'b']",)),
    "domain_complex.yaml": ("params.b.domain", ("invalid domain 'complex'",)),
    "domain_float32_empty.yaml": ("params.b.domain", ("holds no float32 value",)),
    "domain_float32_overflow.yaml": ("params.b.domain", ("beyond float32's range",)),
    "learnable_yes.yaml": ("params.b.learnable", ("expected true or false, got 'yes'",)),
    "value_outside_domain.yaml": ("params.b.value", ("-1 is not a number in the domain positive",)),
    "value_with_init.yaml": ("params.b.value", ("either 'value'",)),
    "value_huge.yaml": ("params.b.value", ("larger than 1e+12",)),
    "value_float32_underflow.yaml": ("params.b.value", ("below float32's smallest normal",)),
    "params_not_mapping.yaml": ("params", ("must be a mapping",)),
    # denial of service
    "dos_max_many_arguments.yaml": ("log_prior", ("Max takes at most 8 arguments", "got 60")),
    "dos_max_nested.yaml": ("log_prior", ("Max takes at most 8 arguments", "got 64")),
    "dos_piecewise_many.yaml": ("log_prior", ("Piecewise takes at most 16 pairs",)),
    "dos_nested_sinh.yaml": ("log_prior", ("grows to more than 20000 terms",)),
    "dos_clamped_kinks.yaml": ("log_prior", ("has grown to more than 500 terms",)),
    "too_many_kinks.yaml": ("log_prior", ("9 distinct kinks", "the limit is 8")),
    "dos_heavy_inits.yaml": ("params.p2.init", ("288 operations in h and H", "the limit is 256")),
    "dos_yaml_merge_bomb.yaml": ("bomb.l8", ("merge keys ('<<') are not supported",)),
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
    "lone_surrogate.yaml": ("log_prior", ("lone surrogate character",)),
}


@dataclass(frozen=True)
class Builds:
    """A file that must build into a correct module: its log-prior written again in torch for
    the reference, and per-head parameter values to test with."""
    log_prior: object                 # (d, p) -> tensor, float64 or float32
    params: dict[str, list[float]]
    q_offset: int = 15                # Nk - Nq + 3 for the shapes below
    strategy: str | None = None       # the plan the cost model must pick (None: any)
    score: object = None              # (s, lp, n, p) -> logit; None: s + lp


def _abs(x):
    return torch.abs(x)


BUILDS: dict[str, Builds] = {
    # parameters named like the compiler's temporaries: c<k> (hoisted), x<k> (CSE), b<k> (bias)
    "collide_temporaries.yaml": Builds(
        lambda d, p: -(_abs(d - p["x0"]) / p["c0"]) ** 2 - p["b0"] * _abs(d),
        {"c0": [3.0, 5.0], "x0": [0.5, -1.5], "b0": [0.25, 0.0]}),
    # r<k>: the hoisted constants of the causal ramp (ALiBi's row and column terms)
    "collide_ramp.yaml": Builds(
        lambda d, p: -_abs(d) / p["r0"] - p["r1"] * _abs(d),
        {"r0": [3.0, 6.0], "r1": [0.125, 0.5]}, strategy="inline"),
    # the ramp detection put a symbol d_causal in place of d: a parameter of that name doubled
    # the slope on the Triton path
    "collide_d_causal.yaml": Builds(
        lambda d, p: -_abs(d) / p["b"] - p["d_causal"],
        {"b": [3.0, 5.0], "d_causal": [1.5, 0.25]}, strategy="inline"),
    # the table strategy's gathered entries tab_v and tab_<param>
    "collide_table_entry.yaml": Builds(
        lambda d, p: -(_abs(d - p["tab_b"]) / p["b"]) ** p["tab_v"],
        {"b": [4.0, 2.5], "tab_b": [0.5, -1.5], "tab_v": [1.5, 0.8]}, strategy="table"),
    # tanh in exponentials on the Triton path: far keys (|d|/b > 88) gave inf/inf = nan
    "tanh_beyond_88.yaml": Builds(
        lambda d, p: -8 * torch.tanh(_abs(d) / p["b"]) - p["c"] * _abs(p["i"]),
        {"b": [4.0, 1.0], "c": [0.001, 0.0]}, q_offset=400, strategy="inline"),
    # exp overflows float32 at |d| > 88 where the log-prior is about -|d|: the distance table is
    # computed in float64, so a key 400 tokens away keeps its weight
    "float32_intermediate_overflow.yaml": Builds(
        # (softplus: the same function, in a form whose float32 evaluation, the tolerance's
        # yardstick, does not overflow either)
        lambda d, p: -torch.nn.functional.softplus(_abs(d) / p["b"]), {"b": [1.0, 2.0]},
        q_offset=400),
    # a constant that is 0 on a GPU (exp(-100), a float32 denormal) under a log: fine in the
    # float64 table
    "constant_float32_underflow.yaml": Builds(
        lambda d, p: torch.log(_abs(d) + math.exp(-100)) / p["b"], {"b": [4.0, 2.0]}),
    # a few nested tanh: the printer's rewrite copied each argument four times per level
    "dos_nested_tanh.yaml": Builds(
        lambda d, p: -4 * _nest(torch.tanh, 8, _abs(d) / p["b"]), {"b": [64.0, 2.0]}),
    # nested powers with a learnable exponent in (0, 1)
    "dos_power_tower_param.yaml": Builds(
        lambda d, p: -torch.log(_tower(_abs(d) + 1, p["a"], 6) + 1), {"a": [0.5, 0.9]}),
    # names the generated code also uses (a builtin, nn.Module's attributes, the storage prefix
    # raw_, a local t, the kernels' rows, a leading '_'): once refused, they are the user's,
    # and the compiler renames its own around them
    # Python keywords: the parser reads them as names, attention() takes **{"lambda": ...}
    "shadow_lambda.yaml": Builds(
        lambda d, p: -_abs(d) / p["lambda"] - p["in"] * torch.log(1 + _abs(d)),
        {"lambda": [4.0, 2.0], "in": [0.5, -0.25]}),
    "shadow_builtin_float.yaml": Builds(lambda d, p: -_abs(d) / p["float"], {"float": [4.0, 2.0]}),
    "shadow_builtin_range_buffer.yaml": Builds(lambda d, p: -_abs(d) * p["range"],
                                               {"range": [0.25, 0.5]}),
    "shadow_module_training.yaml": Builds(lambda d, p: -_abs(d) * p["training"],
                                          {"training": [0.25, 0.5]}),
    "shadow_module_cuda.yaml": Builds(lambda d, p: -_abs(d) / p["cuda"], {"cuda": [4.0, 2.0]}),
    "shadow_raw_prefix.yaml": Builds(lambda d, p: -_abs(d) / p["b"] - p["raw_b"],
                                     {"b": [4.0, 2.0], "raw_b": [0.0, 0.5]}),
    "shadow_local_t.yaml": Builds(lambda d, p: -_abs(d) / p["b"], {"b": [4.0, 2.0], "t": [1.0, 0.5]},
                                  score=lambda s, lp, n, p: (s + lp) * p["t"]),
    "shadow_table_rows.yaml": Builds(lambda d, p: -(_abs(d) / p["rows"]) ** 1.5,
                                     {"rows": [4.0, 2.0]}),
    "param_underscore.yaml": Builds(lambda d, p: -_abs(d) + 0 * p["_b"], {"_b": [1.0, 2.0]}),
    # an init that breaks only beyond the ordinary head counts (200 heads): the module built
    # for such a count says so (test_an_init_that_breaks_at_an_unusual_head_count_...)
    "init_log_negative_heads.yaml": Builds(lambda d, p: -_abs(d) * p["b"], {"b": [0.5, 1.5]}),
    # a Piecewise in an init (one value for the first heads, another for the rest)
    "init_piecewise.yaml": Builds(lambda d, p: -_abs(d) * p["b"], {"b": [1.0, 2.0]}),
    # i of a real token is never negative: a padding token's position reaches no formula
    "negative_positions.yaml": Builds(lambda d, p: -_abs(d) * torch.log(1 + p["i"]) / p["w"],
                                      {"w": [8.0, 4.0]}),
}


def _nest(fn, times, x):
    for _ in range(times):
        x = fn(x)
    return x


def _tower(x, a, levels):
    for _ in range(levels - 1):
        x = x ** a + 1
    return x ** a


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


def _build_in_process(path: Path, workdir: Path, had_output: bool) -> Run:
    """`bamgen build PATH -o WORKDIR/out` through the CLI's own code, with WORKDIR as the
    working folder (where an injected `touch PWNED` would land)."""
    out = workdir / "out"
    if had_output:
        out.mkdir()
        (out / "hostile.py").write_text(SENTINEL)
    before = _snapshot(workdir)
    start = time.monotonic()
    result = _cli("build", str(path), "-o", str(out), cwd=workdir)
    seconds = time.monotonic() - start
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Run(path, workdir, out, had_output, result.exit_code, result.stdout, result.stderr,
               seconds, before, _snapshot(workdir))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    """Every corpus file built once, in turn (the CLI's time limits need the main thread)."""
    return {name: _build_in_process(HOSTILE / name, tmp_path_factory.mktemp("hostile"),
                                    k % 2 == 1 and name in EXPECTED)
            for k, name in enumerate(sorted(EXPECTED) + sorted(BUILDS))}


def test_every_hostile_file_has_an_expectation():
    on_disk = {p.name for p in HOSTILE.iterdir()}
    assert on_disk == set(EXPECTED) | set(BUILDS)
    assert not set(EXPECTED) & set(BUILDS)
    assert len(on_disk) >= 140


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hostile_file_is_refused_cleanly(runs, name):
    run = runs[name]
    field, words = EXPECTED[name]
    assert "Traceback" not in run.stderr + run.stdout, run.stderr
    assert run.returncode == 2, run.stderr + run.stdout
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


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_hostile_file_builds_a_correct_module(runs, name):
    run = runs[name]
    case = BUILDS[name]
    assert run.returncode == 0, run.stderr
    assert run.seconds < LIMIT_S, f"{name} took {run.seconds:.1f} s"
    built = sorted(run.out.glob("*.py"))
    assert len(built) == 1
    module = import_module_file(built[0])
    if case.strategy:
        assert module.PRIOR["strategy"] == case.strategy
    for backend, causal in (("torch", True), ("torch", False), ("triton", True)):
        _check_against_reference(module, case, backend, causal, context=f"{name} {backend}")


def _check_against_reference(module, case: Builds, backend: str, causal: bool, context: str):
    torch.manual_seed(3)
    B, H, Nq, Nk, D = 1, 2, 7, 19, 16
    q, k, v = torch.randn(B, H, Nq, D), torch.randn(B, H, Nk, D), torch.randn(B, H, Nk, D)
    dout = torch.randn(B, H, Nq, D)
    params = {n: torch.tensor(vals, dtype=torch.float32) for n, vals in case.params.items()}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    p_leaves = {n: t.clone().requires_grad_(n in module.LEARNABLE) for n, t in params.items()}
    out = module.attention(*leaves, **p_leaves, causal=causal, q_offset=case.q_offset,
                           backend=backend)
    learnable = [n for n in params if n in module.LEARNABLE]
    grads = torch.autograd.grad(out, leaves + [p_leaves[n] for n in learnable], dout)
    kw = dict(causal=causal, q_offset=case.q_offset, dout=dout)
    if case.score is not None:
        kw["score"] = case.score
    ref = reference_attention(q, k, v, params, case.log_prior, **kw)
    pt = reference_attention(q, k, v, params, case.log_prior, compute_dtype=torch.float32, **kw)
    results = [("out", out, ref.out, pt.out), ("dq", grads[0], ref.dq, pt.dq),
               ("dk", grads[1], ref.dk, pt.dk), ("dv", grads[2], ref.dv, pt.dv)]
    results += [(f"d{n}", g, ref.dparams[n], pt.dparams[n]) for n, g in zip(learnable, grads[3:])]
    assert all(torch.isfinite(r).all() for _, r, _, _ in results), context
    assert_all_close(results, torch.float32, context=context)


# --------------------------------------------------------------------------------------------
# files that are not regular text files, through a real process

def _refused_by_cli(path: Path | str, tmp_path: Path, words: str) -> None:
    start = time.monotonic()
    res = run_cli("build", str(path), "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert time.monotonic() - start < SUBPROCESS_LIMIT_S
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and words in lines[0], res.stderr
    assert not (tmp_path / "out").exists()


def test_a_link_to_an_endless_device_is_refused_unread(tmp_path):
    """Reading /dev/zero whole never ends (and eats memory): the file is never read whole."""
    link = tmp_path / "zero.yaml"
    link.symlink_to("/dev/zero")
    _refused_by_cli(link, tmp_path, "not a regular file")


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    _refused_by_cli(fifo, tmp_path, "not a regular file")


def test_a_folder_or_an_empty_path_is_refused_in_one_line(tmp_path):
    """A folder, or '' (which Path reads as the current folder), was opened, then os.fdopen
    refused it: 'internal error while building (IsADirectoryError: ... Is a directory: 3)' from
    the CLI and a raw IsADirectoryError naming a file descriptor from bamgen.load."""
    import bamgen
    folder = tmp_path / "a_folder.yaml"
    folder.mkdir()
    _refused_by_cli(folder, tmp_path, "not a regular file (a folder)")
    _refused_by_cli("", tmp_path, "the path is empty")
    for command in ("show", "inspect"):
        res = run_cli(command, "", cwd=tmp_path)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        lines = res.stderr.splitlines()
        assert len(lines) == 1 and "'': the path is empty" in lines[0], res.stderr
    for path, words in ((folder, "not a regular file (a folder)"), ("", "the path is empty")):
        with pytest.raises(bamgen.SpecError, match=re.escape(words)):
            bamgen.load(path, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_a_refusal_by_the_domain_scan_in_a_fresh_process(tmp_path):
    """The scan runs printed code, which can need what a fresh interpreter has not imported yet
    (torch imports itself from C code now and then); in this process it has."""
    _refused_by_cli(HOSTILE / "positive_infinity.yaml", tmp_path, "the log-prior is +inf at d = 0")


def test_a_huge_sparse_file_is_refused_unread(tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as fh:
        fh.truncate(8 << 30)          # 8 GiB, sparse: takes no disk space
    _refused_by_cli(big, tmp_path, "larger than 65536 bytes")


# --------------------------------------------------------------------------------------------

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


def _cli(*args: str, cwd: Path):
    """The CLI in this process (click's runner), with ``cwd`` as the working folder."""
    return run_cli_in_process(*args, cwd=cwd)


def test_late_refusals_leave_a_built_module_of_the_same_name_untouched(tmp_path):
    """Each bad file names the module an earlier build wrote, and fails only in the maths."""
    out = tmp_path / "out"
    good = write_prior(tmp_path, GOOD, "good.yaml")
    assert _cli("build", str(good), "-o", str(out), cwd=tmp_path).exit_code == 0
    before = _snapshot(out)
    assert list(before) == ["hostile.py"]
    for name in ("logit_not_finite_at_init.yaml", "exp_tower_negated.yaml",
                 "constant_overflow.yaml", "pole_between_check_points.yaml",
                 "constant_float32_overflow.yaml"):
        res = _cli("build", str(HOSTILE / name), "-o", str(out), cwd=tmp_path)
        assert res.exit_code == 2 and len(res.stderr.splitlines()) == 1, res.stderr
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
    res = _cli("build", str(prior), "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert res.exit_code == 0, res.stderr
    assert (tmp_path / "out" / "by_head.py").is_file()


def test_an_init_that_breaks_at_an_unusual_head_count_names_the_parameter_and_head(runs):
    """init: log(200 - H) holds for every ordinary head count (the build checks up to 128), so
    the file builds; a module made for 200 heads or more cannot start from it, and says which
    parameter, head and value."""
    module = import_module_file(runs["init_log_negative_heads.yaml"].out / "hostile.py")
    layer = module.HostileAttention(num_heads=8)
    assert torch.allclose(layer.prior_params()["b"], torch.full((8,), math.log(192.0)))
    with pytest.raises(ValueError, match=r"init of b cannot be computed for head 0 of 200"):
        module.HostileAttention(num_heads=200)
    with pytest.raises(ValueError, match=r"init of b cannot be computed for head 0 of 300"):
        module.default_params(300)


def test_an_init_outside_its_domain_at_an_unusual_head_count_names_the_head(tmp_path):
    prior = write_prior(tmp_path, """
        name: shrinking
        log_prior: -Abs(d) / b
        params:
          b: {init: "1 - h/200", domain: positive}
        """)
    res = _cli("build", str(prior), "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert res.exit_code == 0, res.stderr
    module = import_module_file(tmp_path / "out" / "shrinking.py")
    module.ShrinkingAttention(num_heads=128)
    with pytest.raises(ValueError, match=r"b must be positive .* got 0\.0 for head 200"):
        module.ShrinkingAttention(num_heads=300)
