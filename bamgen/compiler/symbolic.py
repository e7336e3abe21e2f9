"""Stage 2: the prior as SymPy mathematics (:class:`PriorIR`).

From a :class:`PriorSpec` this builds the full logit over the content score ``s`` and the
positions, its derivative with respect to ``s`` (the chain factor of dq and dk) and with respect
to every learnable parameter, and makes every one of them safe to evaluate in floating point:

* derivatives of ``sign``/``floor``/``ceiling`` (Dirac deltas) are 0 almost everywhere;
* at a kink ``|u| = 0`` where an expression is 0·log 0, 0/0 or 0·∞, the expression is guarded by
  ``Piecewise((limit, Eq(u, 0)), (expr, True))``. The limit is taken from ``|u| → 0+`` with the
  convention that the derivative of ``|u|`` at 0 is 0 (torch's subgradient), so a factor
  ``sign(u)`` is 0 there whatever it multiplies;
* where that limit is infinite, the kink is clamped to ``|u| = KINK_EPSILON`` and a note says so,
  but for a limit of -oo of the logit or the log-prior itself: a zero of the prior, kept.
* where the limit hangs on the sign of a parameter the domain leaves open (|u|**p, p real), it
  is taken for each sign and selected by the parameter's value at run time (_kink_value).

Every expression is bounded in size (:data:`MAX_TREE` nodes, counted as the tree SymPy's own
walks visit) after each step that can grow it, and the whole stage in CPU time
(:func:`bamgen.compiler.timeout.cpu_budget`), so that no prior file can make it run or grow for long.
Whether the results are finite over the domain is checked on the printed code
(:mod:`bamgen.checks.scan`).
"""
from __future__ import annotations

import contextvars
from dataclasses import dataclass

import sympy as sp

from ..errors import SpecError, SpecWarning
from .formula import MAX_SUM_TERMS, MAX_TREE, tree_size
from .spec import MAX_CHANNELS, PriorSpec, position_names, position_symbols
from .timeout import cpu_budget, working_on

KINK_EPSILON = 1e-5   # the BAM authors' own epsilon, used only where a limit is infinite
# The symbolic work of a build, counted (the clock is only a far guard: timeout.py), so that
# the same file always builds or is always refused, whatever the machine's load:
MAX_DERIVATIVE_NODES = 200_000   # nodes of the logit's derivatives, all together (FIRE: 9,000)
MAX_LIMITS = 32                  # symbolic limits taken at kinks, all expressions together
MAX_KINKS = 8         # distinct Abs(u) kinks per expression; each costs a symbolic limit
MAX_SIGN_SPLITS = 2   # parameters by whose signs a kink's limit is taken, case by case (3**2 limits)


@dataclass
class _SignSplits:
    """Whether this analysis may take a kink's limit by the signs of parameters (allowed), and
    how many kinks it took so (taken): an analysis that split and then outgrew a limit on its
    size is run again with one clamp per kink, as before splits existed (analyse)."""
    allowed: bool = True
    taken: int = 0


_SPLITS: contextvars.ContextVar[_SignSplits | None] = contextvars.ContextVar("bamgen_sign_splits",
                                                                              default=None)
MAX_LIMIT_TREE = 500   # nodes of an expression whose limit at a kink is taken (limits are slow,
                       # and a kink without a finite limit doubles the expression)

class InternalSymbol(sp.Symbol):
    """A symbol of the compiler's own (a gathered table entry). Being of another type, it never
    equals a parameter's Symbol of the same name (a parameter may be called tab_v), while it
    sorts, and so prints in the same order, as a Symbol would."""

    @classmethod
    def class_key(cls):
        return sp.Symbol.class_key()


S = sp.Symbol("s", real=True)
# every position symbol of any channel count (d, i, j, n and d0, i0, j0, ...): a prior's formula
# holds those of its own count only
_ALL_POSITIONS = {**position_symbols(MAX_CHANNELS), **position_symbols()}
_SUFFIXES = ("",) + tuple(str(c) for c in range(MAX_CHANNELS))
LOG_PRIOR = sp.Symbol("log_prior", real=True)
TABLE_VALUE = InternalSymbol("tab_v", real=True)   # a gathered table entry: log_prior(d)


@dataclass(frozen=True)
class PriorIR:
    """The prior's mathematics, ready for lowering."""
    spec: PriorSpec
    log_prior: sp.Expr                        # over positions and runtime parameters
    logit: sp.Expr                            # over s, positions, runtime parameters
    dlogit_ds: sp.Expr
    grads: tuple[tuple[str, sp.Expr], ...]    # (learnable scalar's label, d logit / d it)
    runtime_params: tuple[str, ...]           # labels of the scalars passed to kernels, in order
                                              # (b, or w[0] .. w[K - 1] for a vector)
    positions_used: tuple[str, ...]           # which of d, i, j, n the kernels must provide
    notes: tuple[str, ...]                    # build-time remarks (kinks, clamps)
    # (i_c or j_c, d logit / d it) for every channel, i's first: the derivatives of the logit in
    # a query's and a key's position, d_c = i_c - j_c counted in (docs/positions.md)
    position_grads: tuple[tuple[str, sp.Expr], ...] = ()
    warnings: tuple[SpecWarning, ...] = ()    # what builds but is likely not meant

    @property
    def distance_only(self) -> bool:
        """True when the logit depends on (i, j) only through d (a Toeplitz prior)."""
        return set(self.positions_used) <= {"d"}

    @property
    def score_is_identity(self) -> bool:
        return self.dlogit_ds == 1


def table_grad_symbol(param: str) -> sp.Symbol:
    """The gathered table entry d log_prior(d) / d param."""
    return InternalSymbol(f"tab_{param}", real=True)


@dataclass(frozen=True)
class TableIR:
    """A prior split for the table strategy: what is tabulated once per (head, distance), and
    the per-score remainder that reads the gathered entries.

    Possible when the log-prior depends on positions through d = i - j alone (the score may
    still use s, n, i, j: SSMax's log(n) stays per score). The per-score expressions are the
    score with ``log_prior`` replaced by :data:`TABLE_VALUE`, and the chain rule through it:
    d logit / d p = (d score / d p) + (d score / d log_prior) * tab_p.
    """
    value: sp.Expr                              # log_prior (for s + b: b) over d and parameters
    value_grads: tuple[tuple[str, sp.Expr], ...]  # (param, d log_prior / d param), guarded
    logit: sp.Expr                              # over s, tab_v, positions, parameters
    dlogit_ds: sp.Expr
    grads: tuple[tuple[str, sp.Expr], ...]      # (learnable param, d logit / d param)


def split_for_table(ir: PriorIR) -> TableIR | None:
    """The table form of ``ir``, or None when what it would tabulate is not a function of d
    alone. A logit s + b (the score is s plus anything of the positions: ``s + log_prior``,
    ``s + 2*log_prior``, ``s + log_prior + c*sin(d)``) tabulates the whole b, which the kernels
    add to s as they add an entry; any other score tabulates the log-prior and reads it per score."""
    pos = position_symbols()
    spec = ir.spec
    score = S + LOG_PRIOR if spec.score is None else _score_formula(spec)
    if ir.score_is_identity:
        tabulated_expr, logit = ir.logit.xreplace({S: sp.S.Zero}), S + TABLE_VALUE
    elif score.has(LOG_PRIOR):
        tabulated_expr, logit = ir.log_prior, score.xreplace({LOG_PRIOR: TABLE_VALUE})
    else:
        return None
    if tabulated_expr.free_symbols & {pos["i"], pos["j"], pos["n"]} or not tabulated_expr.has(pos["d"]):
        return None
    symbols = runtime_symbols(spec)
    notes: list[str] = []    # the kinks are already reported by the inline analysis
    limits = [0]
    value = _guard(tabulated_expr, "the log-prior", notes, limits=limits, value=True)
    present = tabulated_expr.free_symbols
    tabulated = [label for label in learnable_labels(spec) if symbols[label] in present]
    value_grads = tuple(
        (label, _guard(clean_derivative(differentiate(tabulated_expr, symbols[label]), label),
                       f"d log_prior / d {label}", notes, limits=limits))
        for label in tabulated)
    dlds = clean_derivative(differentiate(logit, S), "s")
    chain = differentiate(logit, TABLE_VALUE)
    grads = []
    for label in learnable_labels(spec):
        g = differentiate(logit, symbols[label])
        if label in tabulated:
            g = g + chain * table_grad_symbol(label)
        grads.append((label, _guard(clean_derivative(g, label), f"d logit / d {label}", notes,
                                    limits=limits)))
    return TableIR(value=value, value_grads=value_grads,
                   logit=_guard(logit, "the logit", notes, limits=limits, value=True),
                   dlogit_ds=_guard(dlds, "d logit / d s", notes, limits=limits), grads=tuple(grads))


def analyse(spec: PriorSpec) -> PriorIR:
    """Build the PriorIR of a validated spec (within a CPU budget: see bamgen/compiler/timeout.py)."""
    field = formula_field(spec)
    with cpu_budget(field, "deriving the formula"):
        return _analyse(spec)


def analysed(spec: PriorSpec, then=lambda ir: ir):
    """then(analyse(spec)), the stages after the analysis (the plan, whose table form guards
    the logit again) included; where a kink's limit was taken by the signs of parameters and
    a stage then outgrew a limit on the formula's size, all of it again with one clamp per
    kink, as before limits were taken by sign: a prior that built so
    (-(|d|**p + |d - 2|**r)/b, two kinks with exponents of their own) still builds."""
    splits = _SignSplits()
    try:
        return _with_splits(splits, lambda: then(analyse(spec)))
    except SpecError:
        if not splits.taken:
            raise
    return _with_splits(_SignSplits(allowed=False), lambda: then(analyse(spec)))


def _with_splits(splits: _SignSplits, fn):
    """fn() with ``splits`` as the analysis's _SignSplits."""
    token = _SPLITS.set(splits)
    try:
        return fn()
    finally:
        _SPLITS.reset(token)


def formula_field(spec: PriorSpec) -> str:
    """The field that holds the log-prior: 'log_prior' or 'density'."""
    return "density" if spec.from_density else "log_prior"


def _analyse(spec: PriorSpec) -> PriorIR:
    notes: list[str] = []
    field = formula_field(spec)
    log_prior = _simplify_log_prior(spec)
    check_size(log_prior, field, "the log-prior")
    if spec.score is None:
        logit = S + log_prior
    else:
        logit = _score_formula(spec).xreplace({LOG_PRIOR: log_prior})
        check_size(logit, "score", "the score")
    symbols = runtime_symbols(spec)
    runtime = tuple(symbols)
    kinks = _written(_kink_arguments(logit), spec)   # before differentiating: each may cost a limit
    if len(kinks) > MAX_KINKS:
        raise SpecError(f"the logit has {len(kinks)} distinct kinks Abs(...); the limit is "
                        f"{MAX_KINKS}", field=field, hint="combine the Abs terms or use fewer of them")

    with working_on("score" if spec.score is not None else field, "differentiating the score"):
        dlds = clean_derivative(differentiate(logit, S), "s")
        check_size(dlds, "score", "d logit / d s")
    grads = []
    present = logit.free_symbols
    for label in learnable_labels(spec):
        with working_on(field, f"differentiating the formula in {label}"):
            if symbols[label] in present:
                grad = clean_derivative(differentiate(logit, symbols[label]), label)
            else:   # (an element the formula never reads: a Sum over part of a vector)
                grad = sp.S.Zero
            check_size(grad, field, f"d logit / d {label}")
        grads.append((label, grad))
    total = sum(tree_size(g, {}) for _, g in grads)
    if total > MAX_DERIVATIVE_NODES:
        raise SpecError(f"the derivatives of the logit in its {len(grads)} learnable scalars grow "
                        f"to {total} terms in all; the limit is {MAX_DERIVATIVE_NODES}",
                        field=field, hint="use fewer or smaller vectors, or simplify the formula")
    with working_on(field, "guarding the kinks of the formula"):
        limits = [0]
        logit = _guard(logit, "the logit", notes, field, limits, value=True)
        dlds = _guard(dlds, "d logit / d s", notes, field, limits)
        grads = tuple((name, _guard(g, f"d logit / d {name}", notes, field, limits))
                      for name, g in grads)
    for what, expr in [("the logit", logit), ("d logit / d s", dlds)] + [
            (f"d logit / d {name}", g) for name, g in grads]:
        _check_real_constants(expr, field, what)

    with working_on(field, "differentiating the formula in the positions"):
        position_grads = _position_grads(spec, logit, notes, field, limits)
    exprs = [logit, dlds] + [g for _, g in grads]
    pos = position_symbols(spec.channels)
    used = tuple(n for n in position_names(spec.channels) if any(e.has(pos[n]) for e in exprs))
    return PriorIR(spec=spec, log_prior=log_prior, logit=logit, dlogit_ds=dlds, grads=grads,
                   runtime_params=runtime, positions_used=used, notes=tuple(notes),
                   position_grads=position_grads,
                   warnings=_no_gradient(spec, dict(grads), present))


def _no_gradient(spec: PriorSpec, grads: dict[str, sp.Expr], present: set) -> tuple[SpecWarning, ...]:
    """A warning for each learnable parameter whose every scalar's derivative is 0 (a window's
    width that appears only in a condition, a value under floor or sign, a parameter the
    formula never reads): training would never move it, which is what learnable declares."""
    warnings = []
    for p in spec.params:
        if not p.learnable or any(grads[label] != 0 for label in p.labels()):
            continue
        why = ("the formula never reads it" if not present & set(p.symbols()) else
               "it appears only in a Piecewise condition, or under floor, ceiling or sign")
        warnings.append(SpecWarning(
            f"the learnable parameter '{p.name}' gets no gradient: the logit's derivative in it "
            f"is 0 wherever it is defined ({why}), so training never moves it",
            field=f"params.{p.name}", line=p.line,
            hint="declare it learnable: false, a buffer set at call time"))
    return tuple(warnings)


def _position_grads(spec: PriorSpec, logit: sp.Expr, notes: list[str], field: str,
                    limits: list[int]) -> tuple[tuple[str, sp.Expr], ...]:
    """d logit / d i_c and d logit / d j_c for every channel c, where the formula's d_c is
    i_c - j_c: a query position moves d_c with it, a key position against it. (n, a count of
    keys, is no position.) These give the gradients of position tensors: row and column sums
    of dS times them."""
    pos = position_symbols(spec.channels)
    suffixes = ("",) if spec.channels == 1 else tuple(str(c) for c in range(spec.channels))
    by_d = {c: differentiate(logit, pos[f"d{c}"]) for c in suffixes}
    out = []
    for side, sign in (("i", 1), ("j", -1)):
        for c in suffixes:
            label = f"{side}{c}"
            g = clean_derivative(differentiate(logit, pos[label]) + sign * by_d[c], label)
            check_size(g, field, f"d logit / d {label}")
            g = _guard(g, f"d logit / d {label}", notes, field, limits)
            _check_real_constants(g, field, f"d logit / d {label}")
            out.append((label, g))
    return tuple(out)


def runtime_symbols(spec: PriorSpec) -> dict[str, sp.Symbol]:
    """{label: symbol} of every scalar the kernels receive, in slot order: each scalar
    parameter (b) and each element of a vector (w[0], w[1], ...); constants are folded."""
    return {sym.name: sym for p in spec.params if not p.is_constant for sym in p.symbols()}


def learnable_labels(spec: PriorSpec) -> tuple[str, ...]:
    """The labels of the learnable scalars, in gradient-slot order."""
    return tuple(sym.name for p in spec.params if p.learnable for sym in p.symbols())


def check_size(expr: sp.Basic, field: str, what: str) -> None:
    """Refuse an expression whose tree has more than MAX_TREE nodes (SymPy's walks visit the
    tree, so a shared sub-expression counts at every use; counted here once per node)."""
    if tree_size(expr, {}) > MAX_TREE:
        raise SpecError(f"{what} grows to more than {MAX_TREE} terms", field=field,
                        hint="simplify the formula: fewer nested functions, products of "
                             "parameters or Min/Max arguments")


def _check_real_constants(expr: sp.Basic, field: str, what: str) -> None:
    """No constant that is not a real number (I, zoo, nan) may reach the kernels."""
    if expr.has(sp.I, sp.zoo, sp.nan):
        raise SpecError(f"{what} is not a real number (the log or a fractional power of a "
                        f"negative constant, or a division by zero)", field=field,
                        hint="the formula must be real for every position and parameter value")


def guarded(expr: sp.Expr, what: str, value: bool = False) -> sp.Expr:
    """``expr`` with its removable singularities at kinks replaced by their limits (value: a
    log-prior or a logit, whose limit of -oo is kept: _guard)."""
    return _guard(expr, what, [], value=value)


def _canonical_positions(expr: sp.Expr) -> sp.Expr:
    """Write i as d + j (i_c as d_c + j_c), so a formula in j - i (BAM's own form) is seen to
    depend on d alone. A sum that then holds d + j among other terms (the user's 1 + i, which
    the printed code would compute as d + (j + 1), 0 in float32 at d = -2**24, j = 2**24, i = 0)
    reads i again, the position the kernels have. (d + j alone is exact for token positions,
    integers whose sum lies in [0, 2**24]: FIRE's Max(i, L) stays Max(d + j, L).)"""
    pos = _ALL_POSITIONS
    expr = expr.xreplace({pos[f"i{c}"]: pos[f"d{c}"] + pos[f"j{c}"] for c in _SUFFIXES})
    for c in _SUFFIXES:
        d, i, j = pos[f"d{c}"], pos[f"i{c}"], pos[f"j{c}"]
        if expr.has(d) and expr.has(j):
            expr = expr.replace(lambda e: isinstance(e, sp.Add),
                                lambda e, d=d, i=i, j=j: _read_query(e, d, i, j))
    return expr


def _read_query(add: sp.Add, d: sp.Symbol, i: sp.Symbol, j: sp.Symbol) -> sp.Expr:
    """A sum c*d + c*j + rest as c*i + rest (see _holds_query), any other sum as it is."""
    split = _holds_query(add, d, j)
    return add if split is None else split[0] + split[1] * i


def _holds_query(add: sp.Add, d: sp.Symbol, j: sp.Symbol) -> tuple[sp.Expr, sp.Expr] | None:
    """(rest, c) of a sum c*d + c*j + rest (the same coefficient c, free of positions, on
    both) other than d + j itself, or None."""
    coeffs = {d: [], j: []}
    rest = []
    for term in add.args:
        c, x = term.as_independent(d, j, as_Add=False)
        if x in coeffs and not c.free_symbols & set(_ALL_POSITIONS.values()):
            coeffs[x].append(c)
        else:
            rest.append(term)
    cd, cj = sp.Add(*coeffs[d]), sp.Add(*coeffs[j])
    if cj == 0 or sp.expand(cd - cj) != 0 or (not rest and cj == 1):
        return None
    return sp.Add(*rest), cj


def _simplify_log_prior(spec: PriorSpec) -> sp.Expr:
    expr = _canonical_positions(spec.log_prior)
    bounds = _interval_bounds(spec)
    if spec.causal_only:
        expr = _causal_side(expr)
    if spec.from_density:
        # the log of a piecewise density taken per branch, a branch of 0 as -oo (a window:
        # Piecewise((0, Abs(d) >= W), (density, True))), so that each branch simplifies below
        expr = expr.replace(lambda e: isinstance(e, sp.log) and isinstance(e.args[0], sp.Piecewise),
                            lambda e: sp.Piecewise(*[(-sp.oo if v == 0 else sp.log(v), c)
                                                     for v, c in e.args[0].args]))
        # log of an unnormalised density: split products and powers so log(exp(x)) -> x.
        logs = lambda e: isinstance(e, sp.log)   # noqa: E731
        expr = sp.expand_log(expr.replace(logs, _even_powers_as_abs), force=True)
        expr = sp.logcombine(expr, force=True).replace(logs, _even_powers_as_abs)
        expr = sp.powsimp(sp.expand_log(expr, force=True))
        expr = expr.replace(lambda e: _positive_sum_log(e, bounds), _log_sum_exp)
    else:
        # a mixture or a softplus written as a log-prior: the same log-sum-exp as a density's
        expr = expr.replace(lambda e: _exp_sum_log(e, bounds), _log_sum_exp)
    if expr.has(sp.zoo, sp.nan) or expr == sp.oo:
        field = "density" if spec.from_density else "log_prior"
        raise SpecError("the formula is not finite (division by zero or log of zero)",
                        field=field, hint="check constants; use Abs(...) + eps under logs")
    return expr


def _score_formula(spec: PriorSpec) -> sp.Expr:
    """The score over s, log_prior and the positions, a softplus in it (log(1 + exp(s)), the
    hint for softplus(s)) or a log-sigmoid (-log(1 + exp(-s))) computed as the log-prior's are,
    as a log-sum-exp: exp(s) overflows float32 at s = 89, where the log-sum-exp stays finite.
    Taken before log_prior is put in, whose own log-sum-exps are not taken twice."""
    expr = _canonical_positions(spec.score)
    return expr.replace(lambda e: _exp_sum_log(e, _interval_bounds(spec)), _log_sum_exp)


def _even_powers_as_abs(e: sp.log) -> sp.Expr:
    """log(... * x**(2m) * ...) with x real but of either sign (SymPy folds Abs(d)**2 to d**2)
    holding x**(2m) as Abs(x)**(2m), so that the forced expansion below gives 2m*log(Abs(x))
    and not 2m*log(x), which is nan wherever x < 0 (a density d**2 * exp(-Abs(d)/b))."""
    factors = sp.Mul.make_args(e.args[0])
    even = [f.is_Pow and f.exp.is_integer and f.exp.is_even and f.base.is_extended_real
            and not f.base.is_nonnegative for f in factors]
    if not any(even):
        return e
    return sp.log(sp.Mul(*[sp.Pow(sp.Abs(f.base), f.exp, evaluate=False) if ev else f
                           for f, ev in zip(factors, even)], evaluate=False))


def _causal_side(expr: sp.Expr) -> sp.Expr:
    """A causal-only prior as it is at d >= 0, where it is called: d read as Abs(d), which it
    equals there. d = 0, the diagonal every causal row holds, is then a kink like GGD's, whose
    removable singularities the guards take (d**p's derivative in p, 0*log 0, is 0 there; with
    d itself the scan found it nan and refused KERPLE-power written causally). An Abs(a*d + c)
    whose kink lies at d < 0 (a, c of one sign) becomes Abs(a*Abs(d) + c), which SymPy folds to
    the line a*Abs(d) + c: no kink where no key is."""
    d = position_symbols()["d"]
    return expr.xreplace({d: sp.Abs(d)})


def _interval_bounds(spec: PriorSpec) -> dict:
    """{symbol: (lo, hi)} of the parameters declared in an interval domain, whose bounds SymPy's
    assumptions cannot carry (a weight p in [0, 1] is only `positive` to it)."""
    return {sym: (p.domain.lo, p.domain.hi) for p in spec.params
            if p.domain.kind == "interval" for sym in p.symbols()}


def _is_positive(t: sp.Expr, bounds: dict) -> bool:
    """t > 0 for every value of the parameters in their domains: SymPy's assumptions, and for
    a term in a parameter of an interval (lo, hi) the same term with the parameter written as
    lo + (hi - lo)*z/(1 + z), z > 0, which covers the interval (a mixture's weight 1 - p for p
    in (0, 1) becomes 1/(1 + z))."""
    if t.is_positive:
        return True
    used = {sym: b for sym, b in bounds.items() if sym in t.free_symbols}
    if not used:
        return False
    z = {sym: sp.Dummy("z", positive=True) for sym in used}
    inside = t.xreplace({sym: sp.Rational(lo) + (sp.Rational(hi) - sp.Rational(lo)) * z[sym]
                         / (1 + z[sym]) for sym, (lo, hi) in used.items()})
    return bool(sp.factor_terms(sp.together(inside)).is_positive)


def _positive_sum_log(e: sp.Basic, bounds: dict | None = None) -> bool:
    """log(t_1 + ... + t_n) of terms that are each positive (a mixture density)."""
    return (isinstance(e, sp.log) and isinstance(e.args[0], sp.Add)
            and all(_is_positive(t, bounds or {}) for t in e.args[0].args))


def _exp_sum_log(e: sp.Basic, bounds: dict | None = None) -> bool:
    """log(t_1 + ... + t_n) of positive terms with an exponential among them: a mixture
    (log(exp(-|d|/b1) + a*exp(-|d|/b2))) or a softplus (log(1 + exp(x))) written as a log-prior,
    whose terms underflow or overflow far away as a density's do. (A log of a positive sum
    without exp, KERPLE's log(1 + r*|d|), is left as it is: nothing in it leaves the range.)"""
    return _positive_sum_log(e, bounds) and any(t.has(sp.exp) for t in e.args[0].args)


def _log_sum_exp(e: sp.log) -> sp.Expr:
    """log(sum_k t_k) as M + log(sum_k exp(log t_k - M)), M = Max_k log t_k: the terms of a
    mixture of Gaussians underflow far away (exp(-d**2 / 2 s**2) is 0 in float64 at
    |d| > 39 s), where their sum's log and its derivatives (t_k' / sum) were -inf and 0/0;
    here the largest term is exp(0) = 1 and the others at most 1, so the log stays finite
    and so do its derivatives."""
    logs = [sp.expand_log(sp.log(t), force=True) for t in e.args[0].args]
    top = sp.Max(*logs)
    return top + sp.log(sp.Add(*[sp.exp(x - top) for x in logs]))


class _RealAbs(sp.Function):
    """Abs(u) of a u SymPy cannot prove real (sqrt(i) - sqrt(j): its positions are real, not
    nonnegative), for differentiating alone. SymPy's Abs differentiates such a u through its
    real and imaginary parts (atan2, which no kernel computes); but the printed code computes
    u in real floating point, and a build's scan refuses a formula that is nan (a complex
    branch) where its logit is defined, so wherever the derivative is used u is real and
    d|u| = sign(u) du, as for a real u."""
    nargs = 1

    def fdiff(self, argindex=1):
        return sp.sign(self.args[0])


def differentiate(expr: sp.Expr, x: sp.Symbol) -> sp.Expr:
    """d expr / d x, Abs(u) of every u differentiated as a real u's (_RealAbs)."""
    unproven = lambda e: isinstance(e, sp.Abs) and e.args[0].is_extended_real is not True   # noqa: E731
    if not any(unproven(a) for a in expr.atoms(sp.Abs)):
        return sp.diff(expr, x)
    real = expr.replace(unproven, lambda e: _RealAbs(e.args[0]))
    return sp.diff(real, x).replace(lambda e: isinstance(e, _RealAbs), lambda e: sp.Abs(e.args[0]))


STEPS = (sp.floor, sp.ceiling, sp.sign)   # piecewise constant: a derivative of 0 almost everywhere


def clean_derivative(expr: sp.Expr, wrt: str) -> sp.Expr:
    """Drop Dirac deltas and the derivatives of steps (sign, floor, ceiling: zero almost
    everywhere), the chain rule's Subs(Derivative(floor(x), x), x, u) of a step of an
    expression u included."""
    expr = expr.replace(lambda e: isinstance(e, (sp.DiracDelta,)), lambda e: sp.S.Zero)
    expr = expr.replace(lambda e: isinstance(e, sp.Subs) and isinstance(e.expr, sp.Derivative)
                        and isinstance(e.expr.expr, STEPS), lambda e: sp.S.Zero)
    derivs = expr.atoms(sp.Derivative)
    for der in derivs:
        if isinstance(der.expr, STEPS):
            expr = expr.xreplace({der: sp.S.Zero})
        else:
            raise SpecError(f"cannot differentiate {der.expr} with respect to {wrt}",
                            field="log_prior", hint="rewrite it with differentiable functions")
    return expr


def _written(kinks: list[sp.Expr], spec: PriorSpec) -> set:
    """The kinks as the file writes them: a Sum's body counts once, not once per term
    (PriorSpec.sum_kinks; the symbolic limits they may need are counted apart, MAX_LIMITS)."""
    alias = dict(spec.sum_kinks)
    return {alias.get(u, u) for u in kinks}


def _kink_arguments(expr: sp.Expr) -> list[sp.Expr]:
    """Arguments u of Abs(u) that move with position: candidate kinks of the expression."""
    pos = set(_ALL_POSITIONS.values())
    args = {a.args[0] for a in expr.atoms(sp.Abs) if a.args[0].free_symbols & pos}
    return sorted(args, key=sp.default_sort_key)


def _at_kink(expr: sp.Expr, u: sp.Expr, value: sp.Expr) -> sp.Expr:
    """expr with |u| replaced by value and sign(u) by 0 (the subgradient convention)."""
    return expr.xreplace({sp.sign(u): sp.S.Zero, sp.sign(-u): sp.S.Zero}).xreplace(
        {sp.Abs(u): value, sp.Abs(-u): value})


def _ill_defined(expr: sp.Expr) -> bool:
    # (an infinity on its own is a legitimate value: a window's -oo outside it)
    if expr.has(sp.zoo, sp.nan):
        return True
    return any(p.base == 0 for p in expr.atoms(sp.Pow)) or any(
        a.args[0] == 0 for a in expr.atoms(sp.log))


def _guard(expr: sp.Expr, what: str, notes: list[str], field: str = "log_prior",
           limits: list[int] | None = None, value: bool = False) -> sp.Expr:
    """Replace removable singularities at kinks by their limits (see the module docstring).
    limits: a one-item counter of the limits taken, shared by one build's calls. value: expr
    is the logit or the log-prior, not a derivative, so a limit of -oo is the prior's zero
    there, kept, not clamped (the parameters' symbols carry their domains' signs)."""
    kinks = _kink_arguments(expr)
    if len(kinks) > MAX_KINKS * MAX_SUM_TERMS:
        raise SpecError(f"{what} has {len(kinks)} distinct kinks Abs(...); the limit is "
                        f"{MAX_KINKS * MAX_SUM_TERMS}",
                        field="log_prior", hint="combine the Abs terms or use fewer of them")
    for u in kinks:
        # Judge the raw expression as floating point would evaluate it: |u| = 0 but sign(u)
        # kept symbolic, so sign(u)/|u| reads as 0/0 rather than being cancelled to 0.
        try:
            at_zero = expr.xreplace({sp.Abs(u): sp.S.Zero, sp.Abs(-u): sp.S.Zero})
        except (ValueError, TypeError):
            # SymPy cannot even build it there (Min(15, floor(log(0))): a branch of a Piecewise
            # that another branch covers at 0): no removable singularity to fill in; a value that
            # really breaks is found by the scan of the printed code (bamgen/checks/scan.py)
            continue
        if not _ill_defined(at_zero):
            continue
        if tree_size(expr, {}) > MAX_LIMIT_TREE:
            raise SpecError(f"{what} has grown to more than {MAX_LIMIT_TREE} terms before its "
                            f"limit at {u} = 0 could be taken (each kink without a finite limit "
                            f"doubles it)", field=field,
                            hint="use fewer Abs kinks, or an epsilon: (Abs(x) + 1e-5)**b")
        limit, how = _kink_value(expr, u, value, _LimitCounter(limits, field))
        notes.append(f"{what}: {how}")
        expr = sp.Piecewise((limit, sp.Eq(u, 0)), (expr, True))
        check_size(expr, field, what)   # a clamped kink doubles the expression
    return expr


class _LimitCounter:
    """The symbolic limits one build takes, all kinks and sign cases together (MAX_LIMITS)."""

    def __init__(self, limits: list[int] | None, field: str):
        self.limits, self.field = limits, field

    def take(self) -> None:
        if self.limits is None:
            return
        self.limits[0] += 1
        if self.limits[0] > MAX_LIMITS:
            raise SpecError(f"the formula needs more than {MAX_LIMITS} symbolic limits at its "
                            f"kinks (0/0 or 0*log 0 where an Abs is 0)", field=self.field,
                            hint="use fewer Abs kinks, or an epsilon: (Abs(x) + 1e-5)**b")


def _kink_value(expr: sp.Expr, u: sp.Expr, value: bool, counter: _LimitCounter) -> tuple[sp.Expr, str]:
    """The value ``expr`` takes at ``u = 0`` and a note that says how it was found. Where the
    limit depends on the sign of parameters the domain leaves open (-|d|**p/b: 0 for p > 0,
    -1/b for p = 0, -oo for p < 0), it is taken for each sign apart and selected at run time;
    one clamp for every sign was wrong by |1e-5|**p (-0.32 at p = 0.1)."""
    limit, undecided = _settled_limit(expr, u, value, counter)
    if limit is not None:
        return limit, f"at {u} = 0 the value is {_outcome(limit)}"
    if not undecided:
        return _clamped(expr, u), f"the limit at {u} = 0 is not finite; {_clamp_words(u)}"
    splits = _SPLITS.get()
    if splits is not None and not splits.allowed:
        names = ", ".join(map(str, undecided))
        return _clamped(expr, u), (f"the limit at {u} = 0 depends on the signs of {names}; taken "
                                   f"by sign, the formula outgrew its limits, so "
                                   f"{_clamp_words(u)} for every sign")
    if len(undecided) > MAX_SIGN_SPLITS:
        names = ", ".join(map(str, undecided))
        return _clamped(expr, u), (f"the limit at {u} = 0 depends on the signs of {names}, more "
                                   f"than {MAX_SIGN_SPLITS} parameters to take it by; {_clamp_words(u)}")
    if splits is not None:
        splits.taken += 1
    limit, cases = _by_sign(expr, u, value, undecided, counter)
    detail = "; ".join(f"for {cond} {outcome}" for cond, outcome in cases)
    signs = ", ".join(map(str, undecided))
    return limit, f"at {u} = 0 the value depends on the sign of {signs}: {detail}"


def _clamp_words(u: sp.Expr) -> str:
    """The end of a note on a clamped kink."""
    return f"clamped to |{u}| = {KINK_EPSILON:g} there"


def _clamped(expr: sp.Expr, u: sp.Expr) -> sp.Expr:
    """expr at |u| = KINK_EPSILON, BAM's own epsilon, where no finite limit is to be had."""
    return _at_kink(expr, u, sp.Float(KINK_EPSILON))


def _outcome(limit: sp.Expr) -> str:
    """How a settled limit reads in a note."""
    if limit == -sp.oo:
        return "its limit -oo (a zero of the prior)"
    return f"its limit {limit}"


def _settled_limit(expr: sp.Expr, u: sp.Expr, value: bool,
                   counter: _LimitCounter) -> tuple[sp.Expr | None, list[sp.Symbol]]:
    """(the limit of expr as |u| -> 0+, None where it is not a usable value) and the
    parameters of undecided sign the limit may hang on: those in an exponent of a power of
    |u| (|u|**p), or under a sign() of the limit SymPy gives (-oo*sign(k) for k*log|u|)."""
    counter.take()
    r = sp.Dummy("r", positive=True)
    near = _at_kink(expr, u, r)
    try:
        limit = sp.limit(near, r, 0, "+")
    except (NotImplementedError, ValueError, TypeError, ArithmeticError, RecursionError):
        limit = sp.nan
    # SymPy calls 0**beta finite for a real beta; it is not for beta < 0, nor defined
    # in floating point for beta = 0 (exp2(0 * log2(0)) on the GPU): clamp those too
    if limit.is_finite and not limit.free_symbols & {r} and not _ill_defined(limit):
        return limit, []
    if value and limit == -sp.oo:
        return limit, []
    deciding = {s for pw in near.atoms(sp.Pow) if pw.base.has(r) for s in pw.exp.free_symbols}
    deciding |= {s for sg in limit.atoms(sp.sign) for s in sg.free_symbols}
    return None, sorted((s for s in deciding if len(_sign_cases(s)) > 1), key=sp.default_sort_key)


def _sign_cases(sym: sp.Symbol) -> list[tuple[sp.Basic, sp.Expr, dict, str]]:
    """(condition, what sym becomes, how to write it back, the condition in words) for each
    sign its assumptions allow: none for a position or the compiler's own symbols, which are
    no parameters, and one alone for a positive parameter."""
    if sym in _ALL_POSITIONS.values() or sym == S or isinstance(sym, InternalSymbol):
        return []
    q = sp.Dummy(f"{sym}", positive=True)
    cases = [(sym > 0, q, {q: sym}, f"{sym} > 0", sym.is_positive),
             (sp.Eq(sym, 0), sp.S.Zero, {}, f"{sym} = 0", sym.is_zero),
             (sym < 0, -q, {q: -sym}, f"{sym} < 0", sym.is_negative)]
    return [case[:4] for case in cases if case[4] is not False]


def _by_sign(expr: sp.Expr, u: sp.Expr, value: bool, undecided: list[sp.Symbol],
             counter: _LimitCounter) -> tuple[sp.Expr, list[tuple[str, str]]]:
    """expr's value at u = 0 as a Piecewise on the sign of undecided[0], each case's limit
    taken with the parameter of that sign (and by the next parameter's sign where it still
    hangs on it), clamped where that case has no finite limit; with each case's note."""
    sym, rest = undecided[0], undecided[1:]
    branches, cases = [], []
    for cond, replacement, back, words in _sign_cases(sym):
        case_expr = expr.xreplace({sym: replacement})
        limit, still = _settled_limit(case_expr, u, value, counter)
        if limit is not None:
            inner, notes = limit, [(words, _outcome(limit))]
        elif [s for s in still if s in rest]:
            inner, deeper = _by_sign(case_expr, u, value, [s for s in rest if s in still], counter)
            notes = [(f"{words} and {w}", outcome) for w, outcome in deeper]
        else:
            inner, notes = _clamped(case_expr, u), [(words, f"no limit settled: {_clamp_words(u)}")]
        branches.append((inner.xreplace(back), cond))
        cases.extend(notes)
    if all(b[0] == branches[0][0] for b in branches):
        return branches[0][0], cases
    branches[-1] = (branches[-1][0], True)
    return sp.Piecewise(*branches), cases
