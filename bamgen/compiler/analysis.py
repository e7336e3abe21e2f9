"""What a prior means, at its initial parameters: shape, tail, mode and reach.

Used by ``bamgen show`` and ``bamgen plot``. Everything is evaluated numerically at the init
values of an ``H``-head model (the formulas went through the whitelist, so lambdify only ever
sees SymPy-printed code). A prior that depends on i or j as well as d is analysed at a fixed
query position.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import sympy as sp

from .formula import clamp_index, evaluate
from .spec import position_symbols
from .symbolic import PriorIR

FAR = (1e3, 1e4, 1e5, 1e6)
BELOW_NATS = 20.0
QUERY_POSITION = 1024


@dataclass(frozen=True)
class HeadAnalysis:
    head: int
    mode: int                      # the distance where the prior peaks (within the scan)
    reach: float | None            # |d| beyond which log_prior is BELOW_NATS under the mode
    params: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class PriorAnalysis:
    symmetric: bool                # log_prior(d) == log_prior(-d) at init, for every head
    tail: str                      # flat, polynomial (power p), exponential-type (|d|^p), ...
    normalisable: bool | None      # sum over the integers of exp(log_prior) finite
    heads: tuple[HeadAnalysis, ...]
    distance_only: bool
    causal_only: bool = False      # declared: analysed at d >= 0 alone (symmetric is then False)


def init_values(ir: PriorIR, num_heads: int, seed: int = 0) -> list[dict[sp.Symbol, float]]:
    """Per head, {symbol: init value} for every runtime scalar (each element of a vector). A
    random init is drawn here from Python's generator seeded with ``seed`` (the module draws from
    torch's: these are representative values, not the module's); one shared by the heads is
    drawn once."""
    h, H = sp.Symbol("h", integer=True, nonnegative=True), sp.Symbol("H", integer=True, nonnegative=True)
    rng = random.Random(seed)
    draws = {}
    for p in ir.spec.params:
        if p.random is not None:
            kind, a, b = p.random
            rows = num_heads if p.per_head else 1
            draw = rng.uniform if kind == "uniform" else rng.gauss
            draws[p.name] = [[draw(a, b) for _ in range(p.width)] for _ in range(rows)]
    heads = []
    for head in range(num_heads):   # in float64, as the module computes them (never exactly)
        values = {}
        for p in ir.spec.params:
            if p.is_constant:
                continue
            if p.random is not None:
                row = draws[p.name][head if p.per_head else 0]
                values.update(zip(p.symbols(), row))
            else:
                value = evaluate(p.init_expr, {h: head, H: num_heads})
                values.update({sym: value for sym in p.symbols()})
        heads.append(values)
    return heads


# lambdify's names for the compiler's own functions (a vector's element and its derivative)
_LAMBDIFY = {"Gather": lambda index, *elements: elements[clamp_index(index, len(elements))],
             "Selects": lambda index, k, size: float(clamp_index(index, int(size)) == int(k))}


def log_prior_function(ir: PriorIR, values: dict[sp.Symbol, float], held: str = "query"):
    """A float function of d, for a prior that also reads i or j with one position held at
    QUERY_POSITION: the query's (the key at i - d: the analysis near the mode), or with
    held="key" the key's (the query at j + d: far away, where a key at i - d would sit before
    position 0, where no key is)."""
    pos = position_symbols()
    if held == "query":
        i, j = sp.Integer(QUERY_POSITION), QUERY_POSITION - pos["d"]
    else:
        i, j = QUERY_POSITION + pos["d"], sp.Integer(QUERY_POSITION)
    expr = ir.log_prior.xreplace(values)
    channels = ir.spec.channels
    if channels > 1:
        # a prior over C channels is read along the first (d0 = d), the others' query and key
        # at the same place (d1 = .. = 0): a grid prior along a row
        grid = position_symbols(channels)
        still = sp.Integer(QUERY_POSITION)
        expr = expr.xreplace({grid["d0"]: pos["d"], grid["i0"]: pos["i"], grid["j0"]: pos["j"],
                              **{grid[f"{x}{c}"]: (sp.S.Zero if x == "d" else still)
                                 for c in range(1, channels) for x in "dij"}})
    expr = expr.xreplace({pos["j"]: j, pos["i"]: i, pos["n"]: i + 1})
    fn = sp.lambdify(pos["d"], expr, modules=[_LAMBDIFY, "math"])

    def safe(d: float) -> float:
        try:
            return float(fn(d))
        except (ValueError, ZeroDivisionError, OverflowError):
            return float("nan")
    return safe


def analyse_prior(ir: PriorIR, num_heads: int = 8, scan: int = 4096) -> PriorAnalysis:
    """The analysis at init. A causal-only prior is read at d >= 0 alone: keys after the
    query never meet it, and it need not be defined there."""
    causal_only = ir.spec.causal_only
    heads, symmetric = [], not causal_only
    far = []   # (the tail: far from a key held in place)
    for head, values in enumerate(init_values(ir, num_heads)):
        f = log_prior_function(ir, values)
        far.append(log_prior_function(ir, values, held="key"))
        lps = {d: f(d) for d in range(0 if causal_only else -scan, scan + 1)}
        finite = {d: v for d, v in lps.items() if math.isfinite(v)}
        mode = max(finite, key=lambda d: (finite[d], -abs(d))) if finite else 0
        symmetric = symmetric and all(_same(f(d), f(-d)) for d in (1, 3, 17, 250, 4000))
        heads.append(HeadAnalysis(head=head, mode=mode, reach=_reach(f, mode),
                                  params=tuple((s.name, v) for s, v in values.items())))
    tail, normalisable = _tail(far)
    return PriorAnalysis(symmetric=symmetric, tail=tail, normalisable=normalisable,
                         heads=tuple(heads), distance_only=ir.distance_only,
                         causal_only=causal_only)


def _same(a: float, b: float) -> bool:
    """a and b equal to rounding, or the same infinity (a window's -oo on both sides: their
    difference is nan)."""
    return a == b or abs(a - b) <= 1e-9 * (1 + abs(a))


def _reach(f, mode: int) -> float | None:
    """Smallest |d| (past the mode, on the causal side) where the prior is 20 nats down."""
    top = f(mode)
    if not math.isfinite(top):
        return None
    lo, hi = max(mode, 0), None
    for d in (2 ** k for k in range(0, 31)):
        if d >= lo and f(d) < top - BELOW_NATS:
            hi = d
            break
        lo = max(lo, d)
    if hi is None:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if f(mid) < top - BELOW_NATS else (mid, hi)
    return float(hi)


def _tail(fns) -> tuple[str, bool | None]:
    """Classify the decay of the slowest head far away (fns: each head's log-prior with the key
    held in place, log_prior_function's held="key"). -log_prior growing by the same amount
    per decade of d is logarithmic: a power-law prior |d|^-c, normalisable iff c > 1; growing
    by a factor 10^p per decade is an exponential-type tail exp(-|d|^p), always normalisable."""
    slowest = None
    for f in fns:
        far = [-f(d) for d in FAR]
        if all(v == math.inf for v in far):   # a window: the prior is 0 far away
            kind = (2, 0.0, "compact (the prior is 0 far away)", True)   # (the fastest decay)
            slowest = kind if slowest is None or kind[:2] < slowest[:2] else slowest
            continue
        if not all(math.isfinite(v) for v in far):
            return "undefined far away", None
        if far[-1] - far[0] <= 1e-9 * (1 + abs(far[0])):
            return "flat (no decay)", False
        if far[-1] < far[0]:
            return "growing (anti-local)", False
        step_ratio = (far[3] - far[2]) / (far[2] - far[1]) if far[2] != far[1] else math.inf
        if step_ratio < 1.05:
            c = (far[3] - far[2]) / math.log(10)
            kind = (0, c, f"polynomial (prior ~ |d|^-{c:.2f})", c > 1)
        else:
            p = math.log10(far[3] / far[2])
            kind = (1, p, f"exponential-type (log-prior ~ -|d|^{p:.2f})", True)
        if slowest is None or kind[:2] < slowest[:2]:
            slowest = kind
    return slowest[2], slowest[3]
