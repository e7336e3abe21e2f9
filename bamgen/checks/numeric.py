"""What the generated module will compute, checked at build time in its own arithmetic.

The compiler's symbolic stages reason about formulas over the reals; the module computes them in
float32 (the kernels) from positions that reach 2**24 and parameters anywhere in their domains.
This module evaluates, over grids that cover those ranges, exactly what the module evaluates:

* :func:`init_problem`: a parameter's ``init`` for every head of every ordinary head count (up
  to :data:`MAX_HEADS`), as ``default_params`` computes it (float64 arithmetic, stored as float32);
* :func:`scan_plan` (bamgen/checks/scan.py): the printed kernel code itself.

It needs torch, which every user of a generated module has; it is imported here, lazily, so that
the CLI's other commands and a file refused early do not pay for it.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Mapping

import sympy as sp
import torch

from ..compiler.formula import unique_nodes

MAX_HEADS = 128                        # the ordinary head counts: inits are checked for every
                                       # H in 1..MAX_HEADS at build time (a module built for more
                                       # heads checks its own, docs/priors.md "Inits")
MAX_INIT_OPERATIONS = 256              # distinct operations in h, H over all inits of a prior:
                                       # each is computed for 8,256 (head, head count) pairs
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32; GPUs flush below it to 0


def to_float32(x: float) -> float:
    """``x`` rounded to float32 (±inf beyond its range), as a Python float."""
    return float(torch.tensor(x, dtype=torch.float64).to(torch.float32))


@lru_cache(maxsize=1)
def _head_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """(h, H) for every head h < H of every H in 1..MAX_HEADS, float64, H-major."""
    counts = torch.arange(1, MAX_HEADS + 1, dtype=torch.int64)
    H = counts.repeat_interleave(counts)
    starts = torch.cumsum(counts, 0) - counts
    h = torch.arange(int(H.numel()), dtype=torch.int64) - starts.repeat_interleave(counts)
    return h.double(), H.double()


def grid_operations(expr: sp.Expr) -> int:
    """Distinct sub-expressions of an init that depend on h or H: tensor operations on the grid."""
    return sum(1 for e in unique_nodes(expr) if e.args and e.free_symbols)


def init_grid(expr: sp.Expr) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values float64, h, H) of an init formula on every (head, head count) it can be asked
    for; a formula without h or H is computed once (h = 0, H = 1), one in H alone once per H."""
    h_sym = sp.Symbol("h", integer=True, nonnegative=True)
    H_sym = sp.Symbol("H", integer=True, nonnegative=True)
    h, H = _head_grid()
    if h_sym not in expr.free_symbols:
        if H_sym in expr.free_symbols:
            H = torch.arange(1, MAX_HEADS + 1, dtype=torch.float64)
        else:
            H = torch.ones(1, dtype=torch.float64)
        h = torch.zeros_like(H)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # one thread beats an OpenMP team on a busy machine here
    try:
        values = evaluate_tensor(expr, {h_sym: h, H_sym: H})
    finally:
        torch.set_num_threads(threads)
    return torch.as_tensor(values, dtype=torch.float64).expand(h.shape), h, H


def init_problem(expr: sp.Expr, inside, domain: str) -> str | None:
    """Why an init cannot be the module's starting value for some head count up to MAX_HEADS,
    or None. ``inside(values32)`` is the domain test on the stored float32 values (a bool
    tensor). The message names the first failing head, smallest head count first (none for an
    init without h or H: it is one number for every head)."""
    values, h, H = init_grid(expr)
    stored = values.to(torch.float32)
    checks = (
        (~torch.isfinite(values), ""),
        # (the bounds in full: 2**128 = 3.402823669209385e+38 overflows, and read as beyond 3.4e38
        # it looked equal to it)
        (torch.isinf(stored), f", beyond float32's largest value {FLOAT32_MAX:.8g}: float32 "
                              f"stores it as inf"),
        ((values != 0) & (stored.abs() < FLOAT32_TINY),
         f", below float32's smallest normal value {FLOAT32_TINY:.8g} (a GPU flushes it to 0)"),
        (~inside(stored), f", outside the domain {domain}"),
    )
    for bad, why in checks:
        if bool(bad.any()):
            k = int(torch.nonzero(bad)[0])
            head = f" for head {int(h[k])} of {int(H[k])}" if expr.free_symbols else ""
            return f"gives {float(values[k])!r}{head}{why}"
    return None


# --------------------------------------------------------------------------------------------
# SymPy expressions on tensors, in the arithmetic of the printed Python code (IEEE float64 or
# float32 elementwise; an invalid operation gives nan where Python would raise).

def evaluate_tensor(expr: sp.Basic, values: Mapping[sp.Symbol, torch.Tensor],
                    dtype: torch.dtype = torch.float64):
    """``expr`` elementwise over the tensors in ``values`` (each shared sub-expression once)."""
    memo: dict = {}

    def ev(e):
        if e in memo:
            return memo[e]
        memo[e] = out = _node(e, ev, values, dtype)
        return out

    return ev(expr)


def _number(e: sp.Expr, dtype) -> torch.Tensor:
    try:
        return torch.tensor(float(e), dtype=dtype)
    except (TypeError, ValueError, OverflowError):   # zoo, nan, I: not a real number
        return torch.tensor(math.nan, dtype=dtype)


_FUNCS = {
    sp.exp: torch.exp, sp.log: torch.log, sp.Abs: torch.abs, sp.sign: torch.sign,
    sp.sinh: torch.sinh, sp.cosh: torch.cosh, sp.tanh: torch.tanh, sp.atan: torch.atan,
    sp.erf: torch.erf, sp.floor: torch.floor, sp.ceiling: torch.ceil, sp.sin: torch.sin,
    sp.cos: torch.cos,
}


def _node(e, ev, values, dtype):
    if e in values:
        return values[e].to(dtype)
    if isinstance(e, sp.logic.boolalg.BooleanAtom):
        return torch.tensor(bool(e))
    if e.is_Number or e in (sp.pi, sp.E) or not e.free_symbols:
        return _number(e, dtype)
    if isinstance(e, sp.Piecewise):   # (its arguments are (value, condition) pairs)
        out = ev(e.args[-1].expr)
        for piece in reversed(e.args[:-1]):
            out = torch.where(ev(piece.cond), ev(piece.expr), out)
        return out
    args = [ev(a) for a in e.args]
    if e.is_Add:
        out = args[0]
        for a in args[1:]:
            out = out + a
        return out
    if e.is_Mul:
        out = args[0]
        for a in args[1:]:
            out = out * a
        return out
    if e.is_Pow:
        return torch.pow(*torch.broadcast_tensors(args[0], args[1]))
    if e.func in _FUNCS:
        return _FUNCS[e.func](args[0])
    if e.func in (sp.Min, sp.Max):
        fold = torch.minimum if e.func is sp.Min else torch.maximum
        out = args[0]
        for a in args[1:]:
            out = fold(out, a)
        return out
    if isinstance(e, sp.core.relational.Relational):
        a, b = args
        return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b, "==": a == b,
                "!=": a != b}[e.rel_op]
    if isinstance(e, sp.And):
        return _reduce(args, torch.logical_and)
    if isinstance(e, sp.Or):
        return _reduce(args, torch.logical_or)
    if isinstance(e, sp.Not):
        return torch.logical_not(args[0])
    raise NotImplementedError(f"{type(e).__name__} cannot be evaluated on tensors")


def _reduce(args, op):
    out = args[0]
    for a in args[1:]:
        out = op(out, a)
    return out
