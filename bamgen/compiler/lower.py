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
``c<k>`` (``b<k>``, ``r<k>``). A temporary's SymPy symbol never equals a parameter's: the numbers
k skip every name the expressions already use, so a parameter named ``c0`` makes the hoisted
values ``c1, c2, ...`` rather than two different values sharing one symbol.
"""
from __future__ import annotations

import itertools
import math
import dataclasses
from dataclasses import dataclass

import sympy as sp

from ..errors import SpecError
from . import STRATEGIES
from .formula import ElementFloor, ElementSymbol, Gather, Selects, unique_nodes
from .printers import ExpressionTooLarge, NotARealNumber, prepare, print_expr
from .spec import MAX_CHANNELS, Domain, position_symbols
from .symbolic import (S, TABLE_VALUE, InternalSymbol, PriorIR, TableIR, clean_derivative, formula_field,
                       runtime_symbols, split_for_table, table_grad_symbol)
from .timeout import cpu_budget

# every position symbol of any channel count: never hoisted as a per-program scalar
ALL_POSITIONS = frozenset({**position_symbols(MAX_CHANNELS), **position_symbols()}.values())

# The cost model, in FP32-instruction equivalents per score element on one SM (docs/architecture.md, "Kernels").
# Calibrated against the SASS of the shipped priors (docs/performance.md): what a score costs on
# top of NoPE's, in issue slots, with special functions weighted by their lower rate.
MUFU_COST = 8          # special-function ops (ex2, lg2, rcp, rsq) issue at 16 lanes/cycle vs 128
POSITION_COST = 2      # d = i - j per score: an integer subtract and a conversion to float
GATHER_COST = 3        # a table entry: its address, the load (staged through shared memory)
# A prior with more runtime scalars than this reads its vectors' elements from memory where the
# Triton kernels use them (uniform loads, cached) instead of holding them in registers for the
# whole program: FIRE's 97 weights in registers left too few for the dQ kernel's tiles.
MAX_REGISTER_SCALARS = 16
RAMP_COST = 1          # a causal-side line in d: one add of a column term


@dataclass(frozen=True)
class CodeBlock:
    """Straight-line code that computes ``outputs`` from s, positions and parameters; it reads
    the gathered table entries named in ``table_reads`` (tab_v, tab_<param>)."""
    hoisted: tuple[tuple[str, str], ...]
    body: tuple[tuple[str, str], ...]
    outputs: tuple[str, ...]
    table_reads: tuple[str, ...] = ()


@dataclass(frozen=True)
class ParamPlan:
    """A runtime parameter: its slots in the [H, P] parameter tensor (a vector takes one per
    element, from ``index`` on), how to initialise it, and the kernel names of its scalars."""
    name: str
    index: int
    learnable: bool
    per_head: bool
    init: str               # formula in h, H (Python syntax), or uniform(a, b) / normal(m, s)
    domain: Domain
    grad_index: int | None  # first slot in the gradient outputs, None when not learnable
    size: int | None = None          # a vector's elements; None for a scalar
    idents: tuple[str, ...] = ()     # each scalar's identifier stem: prm_<stem>, tab_<stem>

    @property
    def width(self) -> int:
        return self.size or 1


@dataclass(frozen=True)
class TablePlan:
    """The table strategy's extra facts: which derivative tables exist (slot k + 1 of the
    [H, 1 + len(grads), distances] table holds ``grads[k]``). The tables themselves are filled on
    the host by the module's distance-table code (KernelPlan.distance_table)."""
    ir: TableIR
    grads: tuple[str, ...]         # tabulated parameters, in table-slot order


@dataclass(frozen=True)
class DistanceTable:
    """The log-prior as a function of the distance d alone, printed for torch (and for float64
    Triton: `triton`): evaluated once per (head, distance) in float64, it fills the GPU kernels'
    tables (table strategy) and the CPU path's (a bias for a logit s + f(d); the entries tab_v,
    tab_<p> that `logit` and `backward` read for any other score)."""
    code: CodeBlock                # over pos_d: outputs the log-prior, then one per grad
    grads: tuple[str, ...]         # d log_prior / d p for these learnable parameters, in order
    logit: CodeBlock               # torch: the logit over s, tab_v and positions
    backward: CodeBlock            # torch: (logit, d logit / d s, d logit / d p per learnable p)
    # `code` printed in float64 Triton, which the distance-table kernel runs on the device
    # (bamgen/runtime/triton/table.py); None where the formula reads what has no float64
    # Triton form (atan): the GPU path then builds the table with the torch code
    triton: CodeBlock | None = None


@dataclass(frozen=True)
class RowFactors:
    """A score other than s + log_prior whose derivatives factor into a part that is constant
    along a query row and a per-score part: SSMax's (s + log_prior) * ssmax * log(n) has
    d logit / d s = ssmax * log(n), d logit / d ta = ssmax * log(n) * tab_ta and
    d logit / d ssmax = log(n) * (s + tab_v). The dQ kernel then accumulates the per-score
    parts only and multiplies each row's sums by its row factors once, after the key loop, and
    the dK/dV kernel folds d logit / d s into the row's softmax term: the main loops lose a
    multiply, a compare and a select per score and per parameter (sympy's as_independent
    finds the split, so any such prior gets it)."""
    row: CodeBlock     # over pos_i, pos_n: d logit / d s, then each learnable parameter's row factor
    score: CodeBlock   # per score: each learnable parameter's remaining factor
    # The logit as u * r, r the row's (SSMax's ssmax * log(n)) and u per score (s + tab_v):
    # every kernel computes r * log2(e) once per row and z = u * that, one multiply per score;
    # where u = s + v, u = fma(q.k, scale, v). logit_score's output is v where logit_fma, else u.
    logit_row: CodeBlock | None = None
    logit_score: CodeBlock | None = None
    logit_fma: bool = False
    # parameters whose per-score factor is u (SSMax's ssmax): finite wherever P > 0 (a P > 0
    # needs a finite logit), so the dQ kernel takes u as it is, unclamped
    logit_factor: tuple[str, ...] = ()
    # the row factors read the query position i (not only n and the parameters): the backward's
    # preprocess kernel, which knows no layout's positions, cannot evaluate them for dK/dV
    reads_i: bool = False


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
    table: TablePlan | None = None   # set when strategy == "table"
    distance_table: DistanceTable | None = None   # set when the log-prior is a function of d
    # For a score s + log_prior, triton_fwd holds log_prior alone (the "bias"; empty
    # when tabulated: the table holds it) and triton_bwd the parameter derivatives alone; for any
    # other score, triton_fwd holds the logit and triton_bwd (logit, d logit / d s, derivatives).
    cost: tuple[tuple[str, int], ...] = ()   # the cost model's figures, for `bamgen show`
    ramp: CodeBlock | None = None   # a causal-side linear bias, see _causal_ramp
    # the ramp's prior is even in d (ALiBi's -|d|/b): without the causal mask too, a row's
    # scores are measured from its nearest key, slope * (|d| - |d_ref|) (_ramp_nearest_key)
    ramp_symmetric: bool = False
    # Block skipping (table strategy): key tiles whose table entries (log_prior) are all <= skip
    # are not visited; -inf skips exactly where the prior is -oo, a finite bound is skip_below.
    skip: float | None = None
    row_factors: RowFactors | None = None   # for a score other than s + log_prior, see RowFactors
    # the Triton hooks read each vector's elements from memory at their use (tl.load(prm_w + k),
    # prm_w a pointer) and hoist nothing of them: see MAX_REGISTER_SCALARS
    vectors_in_memory: bool = False
    # d logit / d i_c, then d logit / d j_c, for every channel (PriorIR.position_grads): the
    # gradients of position tensors
    torch_position_grads: CodeBlock | None = None
    # The plan of a call whose positions are tensors (docs/positions.md): inline, without a
    # ramp or row factors (both read token positions), with the position derivatives among the
    # Triton hooks (tensor_positions). A prior over one channel has both plans (positional:
    # the second); a prior over several has this one alone.
    tensor_positions: bool = False
    triton_position_grads: CodeBlock | None = None
    positional: "KernelPlan | None" = None

    @property
    def has_bias_hook(self) -> bool:
        """The kernels call the printed base-2 bias: s + log_prior, inline, log_prior not 0."""
        return (self.score_is_identity and self.table is None
                and self.triton_fwd.outputs[0] not in ("0", "0.0"))

    @property
    def learnable(self) -> tuple[ParamPlan, ...]:
        return tuple(p for p in self.params if p.learnable)


def plan(ir: PriorIR, strategy: str | None = None) -> KernelPlan:
    """Choose the lowering of ``ir`` (by the cost model unless ``strategy`` is given) and print
    its code, within a CPU budget. (The build driver then runs the printed code over the
    domain: bamgen/checks/scan.py.) The torch path's blocks are always the inline ones: it
    builds its own distance tables (bamgen/runtime/tables.py)."""
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    field = formula_field(ir.spec)
    with cpu_budget(field, "lowering the formula"):
        try:
            if ir.spec.channels > 1:   # positions come as tensors only
                if strategy == "table":
                    raise SpecError("--strategy table needs a log-prior in d = i - j alone; a "
                                    "prior over several position channels is inline",
                                    field="positions", hint="build without --strategy")
                return _plan(ir, "inline", positional=True)
            kernel_plan = _plan(ir, strategy)
            kernel_plan = dataclasses.replace(kernel_plan,
                                              positional=_plan(ir, "inline", positional=True))
        except NotARealNumber as exc:
            raise SpecError(f"{exc} (the log or a fractional power of a negative number?)",
                            field=field, hint="the formula must be real for every position "
                                              "and parameter value") from None
        except ExpressionTooLarge as exc:
            raise SpecError(f"written for the kernels (sinh, cosh and tanh in exponentials), the "
                            f"formula grows to {exc}", field=field,
                            hint="nest fewer hyperbolic functions") from None
    return kernel_plan


def _plan(ir: PriorIR, strategy: str | None, positional: bool = False) -> KernelPlan:
    """positional: the plan of calls with position tensors (KernelPlan.tensor_positions)."""
    split = None if positional else split_for_table(ir)
    names = kernel_names(ir)
    ramp = None if positional else _causal_ramp(ir, names)
    cost = _costs(ir, split, ramp is not None)
    skippable = False if positional else _skippable(ir, split)   # (no table: no window to skip)
    if strategy is None:
        strategy = "table" if skippable or _table_wins(dict(cost)) else "inline"
    if strategy == "table" and split is None:
        raise SpecError("--strategy table needs a log-prior (for a score s + b: the b the "
                        "score adds to s) that depends on the positions through d = i - j alone "
                        "(and a score that uses log_prior)",
                        field="log_prior", hint="build with --strategy inline or without --strategy")
    params = param_plans(ir)
    fwd_exprs = [ir.logit]
    bwd_exprs = [ir.logit, ir.dlogit_ds] + [g for _, g in ir.grads]
    blocks = {
        (target, pass_): _code_block(exprs, names, target)
        for target, pass_, exprs in (("triton", "fwd", fwd_exprs), ("triton", "bwd", bwd_exprs),
                                     ("torch", "bwd", bwd_exprs))
    }
    blocks["torch", "fwd"] = (_code_block(fwd_exprs, names, "torch") if positional
                              else _row_first_logit(ir.logit, _per_score(ir, []), names))
    if ir.score_is_identity:
        # logit = s + b(positions): the kernels compute (q.k * scale + b) * log2(e); b is added
        # in natural units, as the reference does (adding log2(e) * b to a base-2 score instead
        # rounds a large b differently and moved dV by 1e-4 in a property test)
        bias = ir.logit.xreplace({S: sp.S.Zero})
        blocks["triton", "fwd"] = _code_block([bias], names, "triton", prefix="b")
        # and d logit / d s = 1: the backward's hook gives the parameter derivatives alone
        blocks["triton", "bwd"] = _code_block([g for _, g in ir.grads], names, "triton")
    table = None
    if strategy == "table":
        table, blocks["triton", "fwd"], blocks["triton", "bwd"] = _table_blocks(split, names, ir)
    distance_table = None
    if split is not None:
        table_names = dict(names)
        table_names.update(_table_names(split, ir))
        table_exprs = [split.value] + [g for _, g in split.value_grads]
        distance_table = DistanceTable(
            code=_code_block(table_exprs, names, "torch64"),
            triton=_float64_triton_block(table_exprs, names),
            grads=tuple(name for name, _ in split.value_grads),
            logit=_row_first_logit(split.logit, _per_score(ir, [TABLE_VALUE]), table_names),
            backward=_code_block([split.logit, split.dlogit_ds] + [g for _, g in split.grads],
                                 table_names, "torch"))
    row_factors = None
    if not ir.score_is_identity and not positional:
        row_factors = _row_factors(ir, split if strategy == "table" else None, names)
    position_grads = [g for _, g in ir.position_grads]
    skip = None
    if strategy == "table" and skippable:
        skip = -ir.spec.skip_below if ir.spec.skip_below else -math.inf
    return KernelPlan(ir=ir, strategy=strategy, params=params, skip=skip,
                      vectors_in_memory=vectors_in_memory(ir),
                      ramp=ramp if strategy == "inline" else None,
                      ramp_symmetric=ramp is not None and strategy == "inline" and _is_even_in_d(ir),
                      positions_used=ir.positions_used, score_is_identity=ir.score_is_identity,
                      triton_fwd=blocks["triton", "fwd"], triton_bwd=blocks["triton", "bwd"],
                      torch_fwd=blocks["torch", "fwd"], torch_bwd=blocks["torch", "bwd"],
                      table=table, distance_table=distance_table, cost=cost,
                      row_factors=row_factors,
                      torch_position_grads=_code_block(position_grads, names, "torch")
                      if position_grads else None,
                      tensor_positions=positional,
                      triton_position_grads=_code_block(position_grads, names, "triton", prefix="e")
                      if positional and position_grads else None)


def _row_factors(ir: PriorIR, split: TableIR | None, names: dict) -> RowFactors | None:
    """Split d logit / d s and each parameter derivative into (row part) * (per-score part), the
    row part a function of i, n and the parameters alone; None unless d logit / d s is all row
    part (then dS times it reaches dQ and dK as a per-row scale)."""
    row_i = [sym for name, sym in position_symbols(ir.spec.channels).items() if name[0] == "i"]
    if split is not None:
        names = {**names, **_table_names(split, ir)}
        dlogit_ds, grads = split.dlogit_ds, split.grads
        table_symbols = [TABLE_VALUE, *(table_grad_symbol(n) for n, _ in split.value_grads)]
    else:
        dlogit_ds, grads, table_symbols = ir.dlogit_ds, ir.grads, []
    per_score = _per_score(ir, table_symbols)
    row_s, rest = dlogit_ds.as_independent(*per_score, as_Add=False)
    if rest != 1:
        return None
    parts = [g.as_independent(*per_score, as_Add=False) for _, g in grads]
    logit = split.logit if split is not None else ir.logit
    logit_row, logit_score = logit.as_independent(*per_score, as_Add=False)
    rest = sp.expand(logit_score - S)
    logit_fma = not rest.has(S)
    return RowFactors(row=_code_block([row_s] + [row for row, _ in parts], names, "triton", prefix="w"),
                      score=_code_block([score for _, score in parts], names, "triton", prefix="g"),
                      logit_row=_code_block([logit_row], names, "triton", prefix="f"),
                      logit_score=_code_block([rest if logit_fma else logit_score], names, "triton",
                                              prefix="h"),
                      logit_fma=logit_fma,
                      logit_factor=tuple(name for (name, _), (_, score) in zip(grads, parts)
                                         if score == logit_score and score.has(S)),
                      reads_i=any(e.has(*row_i) for e in [row_s, logit_row, *(r for r, _ in parts)]))


def _skippable(ir: PriorIR, split: TableIR | None) -> bool:
    """Tiles can be skipped: the log-prior is -oo somewhere (a window), or the file asks for it
    (skip_below); both need the log-prior as a function of d (the table gives the window)."""
    if split is None:
        if ir.spec.skip_below is not None:
            raise SpecError("skip_below needs a log-prior (for a score s + b: the b the score "
                            "adds to s) that depends on the positions through d = i - j alone",
                            field="skip_below",
                            hint="remove skip_below, or write the log-prior and the score's "
                                 "terms beside s in d")
        return False
    return ir.spec.skip_below is not None or split.value.has(sp.S.NegativeInfinity)


def _causal_ramp(ir: PriorIR, names: dict) -> CodeBlock | None:
    """log2(e) * log_prior as ``intercept + slope * d`` on the causal side d >= 0, when it is such
    a line (ALiBi's -|d|/b is): a bias linear in d = i - j is a row term plus a column term, so
    the kernels' steady-state loop adds two broadcast vectors instead of evaluating the prior
    per score. Outputs (slope, intercept, then log(2) * d slope / d p for each learnable p), all
    parameter-only (hoisted constants r<k>)."""
    if not ir.score_is_identity or set(ir.positions_used) - {"d"}:
        return None
    d = position_symbols()["d"]
    d_causal = sp.Dummy("d_causal", nonnegative=True)   # |d| = d, sign(d) in {0, 1}
    bias = (ir.logit.xreplace({S: sp.S.Zero}) / sp.log(2)).xreplace({d: d_causal})
    if bias.has(sp.Piecewise, sp.sign) or not bias.is_polynomial(d_causal):
        return None
    if sp.degree(bias, d_causal) != 1:
        return None
    slope, intercept = sp.diff(bias, d_causal), bias.xreplace({d_causal: sp.S.Zero})
    # d logit / d p = log(2) * (d slope / d p * d + d intercept / d p); measured from a row's
    # reference distance (the kernels' _ramp_reference) only the first term's change survives
    symbols = runtime_symbols(ir.spec)
    slope_grads = [sp.log(2) * clean_derivative(sp.diff(slope, symbols[name]), name)
                   for name, _ in ir.grads]
    return _code_block([slope, intercept, *slope_grads], names, "triton", prefix="r")


def _is_even_in_d(ir: PriorIR) -> bool:
    """The log-prior is the same at d and -d (a function of |d|)."""
    d = position_symbols()["d"]
    bias = ir.logit.xreplace({S: sp.S.Zero})
    return sp.simplify(bias.xreplace({d: -d}) - bias) == 0


def _table_blocks(split: TableIR, names: dict, ir: PriorIR) -> tuple[TablePlan, CodeBlock, CodeBlock]:
    """The main loop's code over the gathered entries tab_v, tab_<param> (the tables are filled
    on the host, see DistanceTable)."""
    names = {**names, **_table_names(split, ir)}
    grads = tuple(name for name, _ in split.value_grads)
    fwd = _code_block([] if ir.score_is_identity else [split.logit], names, "triton")
    head = [] if ir.score_is_identity else [split.logit, split.dlogit_ds]
    bwd = _code_block(head + [g for _, g in split.grads], names, "triton")
    return TablePlan(ir=split, grads=grads), fwd, bwd


# --------------------------------------------------------------------------------------------
# the cost model


def _costs(ir: PriorIR, split: TableIR | None, has_ramp: bool) -> tuple[tuple[str, int], ...]:
    """Per-score cost of the forward logit: inline, as a causal-side ramp (where the prior is a
    line in d there), and as a table gather (where the log-prior is a function of d)."""
    varying = {S, TABLE_VALUE, *ALL_POSITIONS}
    inline = _per_score_cost(ir.logit, varying)
    if ir.positions_used:
        inline += POSITION_COST
    out = [("inline", inline)]
    if has_ramp:
        out.append(("ramp", RAMP_COST))
    if split is not None:
        out.append(("table", _per_score_cost(split.logit, varying) + GATHER_COST))
    return tuple(out)


def _table_wins(cost: dict) -> bool:
    """Tabulate when the gather is cheaper than evaluating the log-prior per score (inline,
    or as a ramp: the inline strategy uses the ramp where it exists)."""
    inline = min(cost["inline"], cost.get("ramp", cost["inline"]))
    return "table" in cost and cost["table"] < inline


def _per_score_cost(expr: sp.Expr, varying: set) -> int:
    """FP32-instruction equivalents of the per-score part of ``expr`` (parameter-only parts are
    hoisted out of the loop and cost nothing here)."""
    _, (body,) = _hoist([prepare(expr, target="triton")], varying)
    return _op_cost(body, varying, {}, _Invariance(varying))


def _op_cost(e: sp.Expr, varying: set, memo: dict, invariant) -> int:
    """Each distinct sub-expression is walked once (memo), but counted at every use, as before:
    the figure is the printed tree's, before common sub-expressions are shared."""
    if e in memo:
        return memo[e]
    if e.is_Atom or invariant(e):
        return 0
    inner = sum(_op_cost(a, varying, memo, invariant) for a in e.args)
    if isinstance(e, (sp.Add, sp.Mul)):
        cost = inner + len(e.args) - 1
    elif isinstance(e, sp.Pow):
        exponent = e.exp
        if exponent.is_Integer and abs(int(exponent)) <= 8:
            cost = inner + abs(int(exponent)) - 1 + (MUFU_COST if exponent < 0 else 0)
        elif exponent == sp.Rational(1, 2) or exponent == sp.Rational(-1, 2):
            cost = inner + MUFU_COST
        else:
            cost = inner + 2 * MUFU_COST + 1          # exp2(e * log2(x))
    elif isinstance(e, (sp.exp, sp.log)):
        cost = inner + MUFU_COST + 1              # exp2 / log2 and the scaling by log2(e)
    elif isinstance(e, (sp.sin, sp.cos)):
        cost = inner + MUFU_COST + 2
    elif isinstance(e, sp.atan):
        cost = inner + MUFU_COST + 12             # polynomial with a reciprocal
    elif isinstance(e, sp.Piecewise):
        cost = inner + len(e.args)
    else:
        cost = inner + 1
    memo[e] = cost
    return cost


class _Invariance:
    """Whether a sub-expression is free of the per-score symbols, each node decided once from
    its arguments (``free_symbols`` would walk the whole tree under it on every call)."""

    def __init__(self, varying: set):
        self.varying = varying
        self.memo: dict = {}

    def __call__(self, e: sp.Basic) -> bool:
        done = self.memo.get(e)
        if done is None:
            if e.is_Symbol:
                done = e not in self.varying
            elif not e.args:
                done = True
            else:
                done = all(self(a) for a in e.args)
            self.memo[e] = done
        return done


def kernel_names(ir: PriorIR) -> dict[sp.Symbol, str]:
    names: dict[sp.Symbol, str] = {S: "s"}
    if ir.spec.channels == 1:
        names.update({sym: f"pos_{name}" for name, sym in position_symbols().items()})
    else:   # channel c of a position is element c of a tuple in the hooks: pos_d[1]
        names.update({sym: f"pos_{name[0]}[{name[1:]}]" if name != "n" else "pos_n"
                      for name, sym in position_symbols(ir.spec.channels).items()})
    for p in ir.spec.params:
        if p.is_constant:
            continue
        if p.size is None:
            names[p.symbol()] = f"prm_{p.name}"
        else:   # a vector is a tuple in the hooks: prm_w[3]
            names.update({sym: f"prm_{p.name}[{k}]" for k, sym in enumerate(p.symbols())})
    return names


def scalar_idents(spec) -> dict[str, str]:
    """{label: identifier stem} of every runtime scalar: a scalar parameter's own name, and
    <name>_<k> for element k of a vector, made unique (a scalar named w_3 beside a vector w
    pushes the element's to w_3_). The kernels call a tabulated derivative tab_<stem> (a
    parameter itself is prm_<name>, a vector's element prm_<name>[k])."""
    stems: dict[str, str] = {}
    taken = {p.name for p in spec.params if p.size is None}
    for p in spec.params:
        if p.is_constant:
            continue
        if p.size is None:
            stems[p.name] = p.name
            continue
        suffix = ""
        while any(f"{p.name}_{k}{suffix}" in taken for k in range(p.size)):
            suffix += "_"
        for k, label in enumerate(p.labels()):
            stems[label] = f"{p.name}_{k}{suffix}"
        taken |= {stems[label] for label in p.labels()}
    return stems


def param_plans(ir: PriorIR) -> tuple[ParamPlan, ...]:
    """The runtime parameters in slot order, each with its first slot and gradient slot."""
    idents = scalar_idents(ir.spec)
    plans, slot, grad_slot = [], 0, 0
    for p in ir.spec.params:
        if p.is_constant:
            continue
        plans.append(ParamPlan(name=p.name, index=slot, learnable=p.learnable,
                               per_head=p.per_head, init=p.init, domain=p.domain,
                               grad_index=grad_slot if p.learnable else None, size=p.size,
                               idents=tuple(idents[label] for label in p.labels())))
        slot += p.width
        grad_slot += p.width if p.learnable else 0
    return tuple(plans)


def _table_names(split: TableIR, ir: PriorIR) -> dict[sp.Symbol, str]:
    """The kernel names of the gathered table entries: tab_v, and tab_<stem> per derivative."""
    idents = scalar_idents(ir.spec)
    return {TABLE_VALUE: "tab_v",
            **{table_grad_symbol(label): f"tab_{idents[label]}" for label, _ in split.value_grads}}


def _fresh_symbols(prefix: str, taken: set[str]):
    """Real symbols prefix0, prefix1, ... skipping every name in ``taken``."""
    for k in itertools.count():
        if f"{prefix}{k}" not in taken:
            yield sp.Symbol(f"{prefix}{k}", real=True)


def _symbol_names(exprs: list[sp.Expr]) -> set[str]:
    return {e.name for expr in exprs for e in unique_nodes(expr) if isinstance(e, sp.Symbol)}


def _hoist(exprs: list[sp.Expr], varying: set, prefix: str = "c",
           taken: set[str] = frozenset()) -> tuple[list[tuple[sp.Symbol, sp.Expr]], list[sp.Expr]]:
    """Pull parameter-only sub-expressions out of per-score expressions. The new symbols skip
    the names in ``taken`` and those of the expressions' own symbols."""
    table: dict[sp.Expr, sp.Symbol] = {}
    order: list[tuple[sp.Symbol, sp.Expr]] = []
    fresh = _fresh_symbols(prefix, set(taken) | _symbol_names(exprs))
    invariant = _Invariance(varying)
    memo: dict = {}

    def name_of(e: sp.Expr) -> sp.Expr:
        if e.is_Atom or isinstance(e, sp.logic.boolalg.BooleanAtom):
            return e
        if e.is_number:
            return e
        if e not in table:
            table[e] = next(fresh)
            order.append((table[e], e))
        return table[e]

    def walk(e):
        if e in memo:
            return memo[e]
        if e.is_Atom or isinstance(e, sp.logic.boolalg.BooleanAtom):
            out = e
        elif isinstance(e, sp.Expr) and invariant(e):
            out = name_of(e)
        elif isinstance(e, (sp.Add, sp.Mul)):
            fixed = [a for a in e.args if invariant(a)]
            moving = [walk(a) for a in e.args if not invariant(a)]
            if fixed:
                out = e.func(name_of(e.func(*fixed)), *moving, evaluate=False)
            else:
                out = e.func(*moving)
        elif isinstance(e, sp.Piecewise):
            out = sp.Piecewise(*[(walk(p.expr), walk(p.cond)) for p in e.args])
        elif isinstance(e, (sp.Min, sp.Max)):
            # (as they were: evaluating would compare every pair of arguments symbolically
            # again, seconds for FIRE's 32 hidden units)
            out = e.func(*[walk(a) for a in e.args], evaluate=False)
        else:
            out = e.func(*[walk(a) for a in e.args])
        memo[e] = out
        return out

    return order, [walk(e) for e in exprs]


def vectors_in_memory(ir: PriorIR) -> bool:
    """The Triton hooks read vector elements from memory (MAX_REGISTER_SCALARS)."""
    return (len(ir.runtime_params) > MAX_REGISTER_SCALARS
            and any(p.size is not None for p in ir.spec.params if not p.is_constant))


def _per_score(ir: PriorIR, table_symbols: list) -> list:
    """What varies along a row of scores: s, d and j (d_c, j_c with channels), table entries;
    the rest of a product over them is the row's (i, n and the parameters)."""
    pos = position_symbols(ir.spec.channels)
    return [S, *(sym for name, sym in pos.items() if name[0] in "dj"), *table_symbols]


ROW_FACTOR = "r_row"   # the torch logit's row factor, computed before the product (below)


def _row_first_logit(logit: sp.Expr, per_score: list, names: dict) -> CodeBlock:
    """The torch logit of a score-scaled prior (logit = r(i, n) * u(s, d): SSMax's
    (s + log_prior) * ssmax * log(n)) with its row factor multiplied out first, as the kernels
    do (z = u * r). Printed as one product, float32 evaluates it left to right: ssmax * (s +
    log_prior) overflowed to -inf for ssmax = 1e30 before log(n) = 0 made it 0, and -inf * 0 is
    NaN where the reference has 0. Other logits: the plain block."""
    row, score = logit.as_independent(*per_score, as_Add=False)
    if row == 1 or not row.free_symbols or score == 1:
        return _code_block([logit], names, "torch")
    factor = sp.Symbol(ROW_FACTOR, real=True)
    block = _code_block([row, score * factor], {**names, factor: ROW_FACTOR}, "torch",
                        varying_too=(factor,))
    first, product = block.outputs
    return dataclasses.replace(block, body=block.body + ((ROW_FACTOR, first),), outputs=(product,))


def _code_block(exprs: list[sp.Expr], names: dict, target: str, prefix: str = "c",
                varying_too: tuple = ()) -> CodeBlock:
    """Hoisted constants are named <prefix>0, <prefix>1, ... (two blocks a kernel uses together
    need different prefixes), per-score temporaries x0, x1, ...; both skip the names of the
    symbols already in use (parameters, positions, table entries). varying_too: symbols of
    values the block's body defines (never hoisted)."""
    varying = {S, TABLE_VALUE, *ALL_POSITIONS, *varying_too,
               *(sym for sym in names if isinstance(sym, InternalSymbol))}
    scalars = [sym for sym in names if sym not in varying]
    if target == "triton" and len(scalars) > MAX_REGISTER_SCALARS:
        # a vector's elements as loads at their use, never hoisted (vectors_in_memory)
        elements = [sym for sym in scalars if isinstance(sym, ElementSymbol)]
        if elements:
            names = {**names, **{sym: f"tl.load(prm_{sym.vector} + {sym.index})" for sym in elements}}
            varying |= set(elements)
    prepared = [prepare(e, target=target) for e in exprs]
    table_reads = tuple(sorted({names[sym] for e in prepared for sym in e.free_symbols
                                if isinstance(sym, InternalSymbol)}))
    taken = {sym.name for sym in names}
    indices, prepared = _name_indices(prepared, taken)
    varying |= {sym for sym, _ in indices}
    taken |= {sym.name for sym, _ in indices}
    hoisted, body_exprs = _hoist(prepared, varying, prefix, taken)
    names = dict(names)
    names.update({sym: sym.name for sym, _ in hoisted})
    hoisted_code = tuple((sym.name, print_expr(e, names, target=target)) for sym, e in hoisted)
    # each vector index first, in float64 (printers._print_Gather reads it by name)
    index_code = tuple((sym.name, print_expr(e, names, target=target, exact=True))
                       for sym, e in indices)
    names.update({sym: sym.name for sym, _ in indices})
    taken |= {sym.name for sym, _ in hoisted} | _symbol_names(body_exprs)
    temps, reduced = sp.cse(body_exprs, symbols=_fresh_symbols("x", taken),
                            optimizations=None, order="canonical")
    names.update({sym: sym.name for sym, _ in temps})
    body = index_code + tuple((sym.name, print_expr(e, names, target=target)) for sym, e in temps)
    outputs = tuple(print_expr(e, names, target=target) for e in reduced)
    return CodeBlock(hoisted=hoisted_code, body=body, outputs=outputs, table_reads=table_reads)


def _float64_triton_block(exprs: list[sp.Expr], names: dict) -> CodeBlock | None:
    """The distance table's expressions in float64 Triton, or None where a function has no
    float64 Triton form (printers.TritonFloat64Printer)."""
    try:
        return _code_block(exprs, names, "triton64")
    except NotImplementedError:
        return None


def _name_indices(exprs: list[sp.Expr], taken: set[str]):
    """Each distinct index e of a vector element w[e] as a symbol k<m> of its own, in every
    expression (the Gather and the derivatives' conditions clamp(e) = k alike), so that common
    sub-expression elimination never computes part of an index in float32 with the rest of the
    formula: ([(k<m>, e)], the expressions over k<m>)."""
    found: list[sp.Expr] = []
    for expr in exprs:
        for node in unique_nodes(expr):
            if isinstance(node, (Gather, Selects)) and node.args[0] not in found \
                    and not node.args[0].is_Atom:
                found.append(node.args[0])
    if not found:
        return [], exprs
    found.sort(key=sp.default_sort_key)
    fresh = _fresh_symbols("k", taken | _symbol_names(exprs))
    # (each named index is its floor, the element w[e] reads: once an index, so that an
    # element's derivative, 1 where it is the one read, is one comparison k<m> == k)
    indices = [(InternalSymbol(next(fresh).name, integer=True), e) for e in found]
    mapping = {e: sym for sym, e in indices}
    return [(sym, ElementFloor(e)) for sym, e in indices], [expr.xreplace(mapping) for expr in exprs]
