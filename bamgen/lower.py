"""Stage 3: the kernel plan — how each expression of a PriorIR is computed.

Per target (Triton, torch) and per pass (forward needs the logit; backward needs the logit, its
derivative in ``s`` and one derivative per learnable parameter) this produces a
:class:`CodeBlock`: straight-line assignments split into

* ``hoisted``: sub-expressions of the parameters alone, computed once per program (Triton) or
  once per call (torch) instead of once per score — e.g. ALiBi's ``-1/b``;
* ``body``: per-score temporaries after common-subexpression elimination across the value and
  all of its derivatives;
* ``outputs``: the printed results, in order.

Names in the printed code never collide with the templates' own: parameters are ``prm_<name>``,
positions ``pos_<d|i|j|n>``, the content score ``s``, temporaries ``x<k>`` and hoisted values
``c<k>``.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from .printers import prepare, print_expr
from .spec import Domain, position_symbols
from .symbolic import S, PriorIR

STRATEGIES = ("inline",)


@dataclass(frozen=True)
class CodeBlock:
    """Straight-line code that computes ``outputs`` from s, positions and parameters."""
    hoisted: tuple[tuple[str, str], ...]
    body: tuple[tuple[str, str], ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class ParamPlan:
    """A runtime parameter: its slot in the [H, P] parameter tensor and how to initialise it."""
    name: str
    index: int
    learnable: bool
    per_head: bool
    init: str               # formula in h, H (Python syntax)
    domain: Domain
    grad_index: int | None  # slot in the gradient outputs, None when not learnable


@dataclass(frozen=True)
class KernelPlan:
    """Everything the templates need about one prior."""
    ir: PriorIR
    strategy: str
    params: tuple[ParamPlan, ...]
    positions_used: tuple[str, ...]
    score_is_identity: bool
    triton_fwd: CodeBlock
    triton_bwd: CodeBlock
    torch_fwd: CodeBlock
    torch_bwd: CodeBlock

    @property
    def learnable(self) -> tuple[ParamPlan, ...]:
        return tuple(p for p in self.params if p.learnable)


def plan(ir: PriorIR, strategy: str | None = None) -> KernelPlan:
    """Choose the lowering of ``ir`` (only ``inline`` exists so far) and print its code."""
    strategy = strategy or "inline"
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    spec_params = {p.name: p for p in ir.spec.params}
    grad_names = [name for name, _ in ir.grads]
    params = tuple(
        ParamPlan(name=name, index=k, learnable=spec_params[name].learnable,
                  per_head=spec_params[name].per_head, init=spec_params[name].init,
                  domain=spec_params[name].domain,
                  grad_index=grad_names.index(name) if name in grad_names else None)
        for k, name in enumerate(ir.runtime_params))
    names = _kernel_names(ir)
    fwd_exprs = [ir.logit]
    bwd_exprs = [ir.logit, ir.dlogit_ds] + [g for _, g in ir.grads]
    blocks = {
        (target, pass_): _code_block(exprs, names, target, ir)
        for target in ("triton", "torch")
        for pass_, exprs in (("fwd", fwd_exprs), ("bwd", bwd_exprs))
    }
    return KernelPlan(ir=ir, strategy=strategy, params=params,
                      positions_used=ir.positions_used, score_is_identity=ir.score_is_identity,
                      triton_fwd=blocks["triton", "fwd"], triton_bwd=blocks["triton", "bwd"],
                      torch_fwd=blocks["torch", "fwd"], torch_bwd=blocks["torch", "bwd"])


def _kernel_names(ir: PriorIR) -> dict[sp.Symbol, str]:
    names: dict[sp.Symbol, str] = {S: "s"}
    names.update({sym: f"pos_{name}" for name, sym in position_symbols().items()})
    for p in ir.spec.params:
        if not p.is_constant:
            names[p.symbol()] = f"prm_{p.name}"
    return names


def _is_invariant(expr: sp.Expr, varying: set) -> bool:
    return not (expr.free_symbols & varying)


def _hoist(exprs: list[sp.Expr], varying: set) -> tuple[list[tuple[sp.Symbol, sp.Expr]], list[sp.Expr]]:
    """Pull parameter-only sub-expressions out of per-score expressions."""
    table: dict[sp.Expr, sp.Symbol] = {}
    order: list[tuple[sp.Symbol, sp.Expr]] = []

    def name_of(e: sp.Expr) -> sp.Expr:
        if e.is_Atom or isinstance(e, sp.logic.boolalg.BooleanAtom):
            return e
        if e.is_number:
            return e
        if e not in table:
            table[e] = sp.Symbol(f"c{len(table)}", real=True)
            order.append((table[e], e))
        return table[e]

    def walk(e):
        if e.is_Atom or isinstance(e, sp.logic.boolalg.BooleanAtom):
            return e
        if isinstance(e, sp.Expr) and _is_invariant(e, varying):
            return name_of(e)
        if isinstance(e, (sp.Add, sp.Mul)):
            fixed = [a for a in e.args if _is_invariant(a, varying)]
            moving = [walk(a) for a in e.args if not _is_invariant(a, varying)]
            if fixed:
                return e.func(name_of(e.func(*fixed)), *moving, evaluate=False)
            return e.func(*moving)
        if isinstance(e, sp.Piecewise):
            return sp.Piecewise(*[(walk(p.expr), walk(p.cond)) for p in e.args])
        return e.func(*[walk(a) for a in e.args])

    return order, [walk(e) for e in exprs]


def _code_block(exprs: list[sp.Expr], names: dict, target: str, ir: PriorIR) -> CodeBlock:
    varying = {S, *position_symbols().values()}
    prepared = [prepare(e, target=target) for e in exprs]
    hoisted, body_exprs = _hoist(prepared, varying)
    names = dict(names)
    names.update({sym: sym.name for sym, _ in hoisted})
    hoisted_code = tuple((sym.name, print_expr(e, names, target=target)) for sym, e in hoisted)
    temps, reduced = sp.cse(body_exprs, symbols=sp.numbered_symbols("x", real=True),
                            optimizations=None, order="canonical")
    names.update({sym: sym.name for sym, _ in temps})
    body = tuple((sym.name, print_expr(e, names, target=target)) for sym, e in temps)
    outputs = tuple(print_expr(e, names, target=target) for e in reduced)
    return CodeBlock(hoisted=hoisted_code, body=body, outputs=outputs)
