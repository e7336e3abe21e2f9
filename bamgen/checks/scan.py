"""The printed kernel code, run over the whole domain before a module is written.

A formula can be fine at a few check points and NaN between them (``log(50 - Abs(d))`` beyond
d = 50), have a pole at one distance (``1/(d - 10)``), be complex for some parameter values
(``sqrt(b - 1)`` for b < 1), or leave float32's range in an intermediate value that the exact
result does not (``exp(100) * Abs(d)`` is inf * 0 at d = 0 in float32). Each of these builds,
then gives NaN or silently wrong rows at run time. So the build runs the code the module will
run, as the module runs it: the distance table (a log-prior in d alone) in float64, the CPU
path's per-score torch expressions in float32 where the module uses them, and the GPU kernels'
Triton expressions in float32 (through :class:`_TritonShim`, the ``tl`` functions on torch
tensors), per score or over the table's float32 entries, over

* positions: every distance |d| <= 4096, then distances up to 2**25 (what two positions of at
  most 2**24 can give) on a log scale, the integers next to every root of a linear or quadratic
  denominator, log argument or power base (where a pole or branch point can sit), and for priors
  in i, j or n, grids of absolute positions down to -2**24 (negative offsets: left padding);
* parameters: the initial values and, one parameter at a time and in seeded random mixes,
  :func:`parameter_samples` across each domain (0.01 to 64 in magnitude);
* content scores s from -1e4 to 1e4, where the score uses them,

and refuses, naming the field, where

1. in float64 the log-prior or the logit is NaN or +inf (a complex branch, a pole): the formula
   itself is broken there; -inf is a legitimate value (a zero of the prior);
2. a derivative the kernels use is NaN where the logit is finite (in float64: the formula; in
   float32: the printed code);
3. the float32 code gives NaN or +inf where the float64 code does not, or -inf where the exact
   value is a moderate number (above -MODERATE nats): an intermediate overflow that turns a
   near key into an impossible one.

Evaluating the printed code is evaluating compiler output: every string comes from
:mod:`bamgen.compiler.printers` over a whitelisted SymPy expression, with identifiers from the
validated parameter names, never from prior-file text.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import sympy as sp
import torch

from ..errors import SpecError
from ..compiler.formula import unique_nodes
from .numeric import FLOAT32_MAX, evaluate_tensor, init_grid
from ..runtime.params import element_at as _element_at
from ..runtime.params import index_ceil as _index_ceil, index_floor as _index_floor
from ..compiler.printers import prepare, print_expr
from ..compiler.spec import POSITION_SYMBOLS, ParamSpec, position_symbols
from ..compiler.symbolic import S, guarded, runtime_symbols

DENSE = 4096                 # every distance up to this is scanned
MAX_POSITION = 2 ** 24       # positions (offsets included) the module accepts
MODERATE = 1e4               # nats: a float32 -inf where the exact value is above -MODERATE is refused
ORDINARY = 1e30              # |log-prior| up to which the score and derivatives must be finite in float64
SCORES = (0.0, 0.5, -0.5, 1.0, -1.0, 10.0, -10.0, 1e-3, -1e-3, 100.0, -100.0, 1e4, -1e4)
MAX_COMBINATIONS = 48        # parameter combinations per scan
MIN_COMBINATIONS = 8         # ... however long the printed code
SCAN_OPERATIONS = 2 * 10**8  # statements x grid points x combinations: the scan's counted work
MAX_SHOWN = 8                # parameter values a message names, beyond those the failing
                             # expression reads (all of which it names)
CHUNK = 1 << 18              # elements per evaluation (memory stays ~ a few MB per temporary)


def parameter_samples(param: ParamSpec) -> list[float]:
    """Values across the domain that a trained parameter may reach."""
    domain = param.domain
    positive = [0.01, 0.1, 0.5, 1.0, 2.0, 4.0, 16.0, 64.0]
    if domain.kind == "positive":
        return positive
    if domain.kind == "nonnegative":
        return [0.0] + positive
    if domain.kind == "interval":
        lo, hi = domain.lo, domain.hi
        return [lo + (hi - lo) * f for f in (1e-3, 0.1, 0.5, 0.9, 0.999)]
    return [0.0] + [s * x for x in (0.1, 0.5, 1.0, 2.0, 4.0, 16.0) for s in (1.0, -1.0)]


# --------------------------------------------------------------------------------------------
# evaluating printed code

class _TorchShim:
    """``torch`` for printed torch code in one dtype: Python numbers become tensors of that
    dtype (the module's own code runs in float32, where torch.where(c, 1.0, 0.0) is float32)."""
    float64 = torch.float64

    def __init__(self, dtype):
        self.dtype = dtype
        self.constants = {}

    def _t(self, x):
        if isinstance(x, torch.Tensor):
            return x
        value = self.constants.get(x)
        if value is None:   # (a printed constant: made once per shim)
            value = self.constants[x] = torch.tensor(float(x), dtype=self.dtype)
        return value

    def as_tensor(self, x, dtype=None):
        x = self._t(x)
        return x if dtype is None else x.to(dtype)

    def tensor(self, x, dtype=None):   # (a float64 branch of the table's code: the scan's dtype)
        return self._t(x)

    def where(self, c, a, b):
        return torch.where(self._t(c).bool(), self._t(a), self._t(b))

    def __getattr__(self, name):
        fn = getattr(torch, name)
        return lambda *args: fn(*[self._t(a) for a in args])


class _Vector(list):
    """A vector parameter's elements in the scan: the torch code indexes it (prm_w[3]); the
    Triton code of a prior that reads its vectors from memory loads through a pointer
    (tl.load(prm_w + 3))."""

    def __add__(self, k):
        return ("element", self, k)


class _TritonShim(_TorchShim):
    """``tl`` for printed Triton code (the functions the printer emits), on torch tensors."""

    def load(self, pointer):
        _, vector, k = pointer
        return vector[k]

    def ceil(self, x):
        return torch.ceil(self._t(x))

    def __getattr__(self, name):
        fn = {"exp2": torch.exp2, "log2": torch.log2, "rsqrt": torch.rsqrt}.get(name) \
            or getattr(torch, name)
        return lambda *args: fn(*[self._t(a) for a in args])


_SHIMS: dict = {}


@lru_cache(maxsize=4096)
def _compiled(code: str):
    return compile(code, "<printed>", "eval")


def run_block(block, inputs: dict, dtype, target: str) -> list[torch.Tensor]:
    """The outputs of a printed CodeBlock at ``inputs`` ({kernel name: tensor})."""
    key = (target, dtype)
    shim = _SHIMS.get(key)
    if shim is None:
        shim = _SHIMS[key] = _TorchShim(dtype) if target == "torch" else _TritonShim(dtype)
    # (the standard builtins: torch imports itself from C code in the eval frame now and then)
    def element_at(index, elements):
        return _element_at(shim._t(index), [shim._t(e) for e in elements], shim.where)
    scope = {"torch": shim, "tl": shim, "_atan": torch.atan, "element_at": element_at,
             "_element": element_at, "index_floor": _index_floor, "_index_floor": _index_floor,
             "index_ceil": _index_ceil, "_index_ceil": _index_ceil}
    def cast(v):
        if isinstance(v, list):
            return _Vector(cast(x) for x in v)
        return v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    env = {k: cast(v) for k, v in inputs.items()}
    for name, code in tuple(block.hoisted) + tuple(block.body):
        env[name] = eval(_compiled(code), scope, env)   # noqa: S307 - compiler-printed code, see module doc
    return [shim._t(eval(_compiled(code), scope, env)) for code in block.outputs]   # noqa: S307


# --------------------------------------------------------------------------------------------
# the grid

@dataclass(frozen=True)
class Point:
    """Where a problem was found, for the message."""
    values: tuple[tuple[str, float], ...]

    def __str__(self) -> str:
        return ", ".join("..." if k == "..." else f"{k} = {_fmt(v)}" for k, v in self.values)


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else f"{v:.6g}"


def _far(limit: int) -> list[int]:
    """Integers from DENSE to ``limit`` on a log scale, and the ones next to powers of two."""
    out = set()
    k = 12
    while 2 ** k <= limit:
        for f in (1.0, 1.25, 1.5, 1.75):
            for o in (-2, -1, 0, 1, 2):
                x = int(2 ** k * f) + o
                if DENSE < x <= limit:
                    out.add(x)
        k += 1
    out.add(limit)
    return sorted(out)


def _distances(extra: set[int]) -> torch.Tensor:
    far = _far(2 * MAX_POSITION)
    values = set(range(-DENSE, DENSE + 1)) | set(far) | {-x for x in far}
    values |= {x for x in extra if abs(x) <= 2 * MAX_POSITION}
    return torch.tensor(sorted(values), dtype=torch.float64)


def _absolute_positions() -> list[int]:
    """Positions of real tokens: 0 to 64, then next to every power of two to 2**24 (a padding
    token's position never reaches a formula: the runtime reads it as 0)."""
    far = [2 ** k + o for k in range(7, 25) for o in (-1, 0, 1) if 2 ** k + o <= MAX_POSITION]
    return sorted(set(range(0, 65)) | set(far))


def _counts() -> list[int]:
    """Numbers of visible keys n: every n <= 64, then powers of two to 2**24."""
    return sorted(set(range(1, 65)) | {2 ** k + o for k in range(6, 25) for o in (-1, 0, 1)
                                       if 2 ** k + o <= MAX_POSITION})


def _position_grid(used: set[str], extra: set[int], causal_only: bool = False) -> dict[str, torch.Tensor]:
    """Float64 position tensors (1-D, one entry per point) for the positions a formula uses.
    d-only: every distance of _distances. With i, j or n: i and j on _absolute_positions
    (d = i - j), and n on _counts, taken in turn so every value meets many positions, plus a
    full block of small i, j and every n. causal_only: only the points whose key is at or
    before its query (d >= 0, j <= i); n keeps its range (offsets and masks set it apart)."""
    grid = _full_grid(used, extra)
    if not causal_only:
        return grid
    keep = grid["d"] >= 0
    return {name: values[keep] for name, values in grid.items()}


def _full_grid(used: set[str], extra: set[int]) -> dict[str, torch.Tensor]:
    """_position_grid's points, keys after their query included."""
    if not used & {"i", "j", "n"}:
        d = _distances(extra)
        return {"d": d}
    absolute = torch.tensor(_absolute_positions(), dtype=torch.float64)
    i, j = torch.meshgrid(absolute, absolute, indexing="ij")
    i, j = i.reshape(-1), j.reshape(-1)
    if "i" not in used and "j" not in used:     # d and n: distances instead of position pairs
        d = _distances(extra)
        i, j = d, torch.zeros_like(d)
    counts = torch.tensor(_counts() if "n" in used else [1], dtype=torch.float64)
    n = counts[torch.arange(i.numel()) % counts.numel()]
    small = torch.arange(0, 17, dtype=torch.float64)
    si, sj, sn = torch.meshgrid(small, small, counts, indexing="ij")
    i, j, n = torch.cat([i, si.reshape(-1)]), torch.cat([j, sj.reshape(-1)]), torch.cat([n, sn.reshape(-1)])
    if "i" not in used and "j" not in used:   # (i = d, j = 0 stand in: no message names them)
        return {"d": i - j, "n": n}
    return {"d": i - j, "i": i, "j": j, "n": n}


def _combinations(params: list[ParamSpec], limit: int = MAX_COMBINATIONS) -> list[dict[str, float]]:
    """Parameter values to scan, {label: value} for every runtime scalar (each element of a
    vector): the init (head 0 of 8), each parameter alone across its samples and its inits for
    other heads and head counts (a vector's elements all at the sample), then seeded random
    mixes (a vector's elements drawn apart). At most ``limit`` when that is below the count."""
    base = {label: _init_at(p, 0, 8) for p in params for label in p.labels()}
    choices = {p.name: _choices(p) for p in params}
    combos = [base]
    per_param = max(4, 2 * MAX_COMBINATIONS // max(len(params), 1))   # many parameters: fewer each
    sweeps = [[{**base, **{label: v for label in p.labels()}}
               for v in _spread(choices[p.name], per_param) if v != base[p.labels()[0]]]
              for p in params]
    if 1 + sum(map(len, sweeps)) <= limit:
        combos += [c for sweep in sweeps for c in sweep]
    else:   # a few of every parameter's samples rather than all of the first ones'
        combos += [sweep[k] for k in range(max(map(len, sweeps))) for sweep in sweeps
                   if k < len(sweep)]
    generator = torch.Generator().manual_seed(0)
    scalars = sum(p.width for p in params)
    while len(combos) < MAX_COMBINATIONS and scalars > 1:
        pick = {label: choices[p.name][int(torch.randint(len(choices[p.name]), (1,),
                                                          generator=generator))]
                for p in params for label in p.labels()}
        combos.append(pick)
    combos = _unique(combos)[:max(MAX_COMBINATIONS, 1 + sum(len(c) for c in choices.values()))]
    return combos[:max(limit, 1)]


def _choices(p: ParamSpec) -> list[float]:
    """A parameter's samples across its domain and its inits: every head of every ordinary head
    count for a formula, the bounds and centre of a uniform draw, the mean and three standard
    deviations each side of a normal one."""
    if p.random is not None:
        kind, a, b = p.random
        inits = [a, (a + b) / 2, b] if kind == "uniform" else [a - 3 * b, a, a + 3 * b]
    else:
        values, _, _ = init_grid(p.init_expr)
        inits = (torch.quantile(values.float(), torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]))
                 if values.numel() > 1 else values.float()).tolist()
    return sorted(set(parameter_samples(p)) | {float(x) for x in inits})


def _spread(values: list[float], count: int) -> list[float]:
    """At most ``count`` of the sorted ``values``, evenly spaced, both ends included."""
    if len(values) <= count:
        return values
    step = (len(values) - 1) / (count - 1)
    return [values[round(k * step)] for k in range(count)]


def _init_at(p: ParamSpec, head: int, heads: int) -> float:
    if p.random is not None:
        return float(p.init_expr)   # the draw's centre
    h, H = sp.Symbol("h", integer=True, nonnegative=True), sp.Symbol("H", integer=True, nonnegative=True)
    value = evaluate_tensor(p.init_expr, {h: torch.tensor(float(head), dtype=torch.float64),
                                          H: torch.tensor(float(heads), dtype=torch.float64)})
    return float(value)


def _unique(combos):
    seen, out = set(), []
    for c in combos:
        key = tuple(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _roots(exprs: list[sp.Expr], params: list[ParamSpec], combos) -> set[int]:
    """Integers next to the real roots in d of the linear and quadratic arguments where a
    formula can break: denominators and other powers' bases, log arguments, and the sides of
    Piecewise conditions (one set of roots per parameter combination)."""
    d = position_symbols()["d"]
    arguments = set()
    for expr in exprs:
        for node in unique_nodes(expr):
            if isinstance(node, sp.Pow) and not (node.exp.is_Integer and node.exp > 0):
                arguments.add(node.base)
            elif isinstance(node, sp.log):
                arguments.add(node.args[0])
            elif isinstance(node, sp.core.relational.Relational):
                arguments.add(node.lhs - node.rhs)
    symbols = {sym.name: sym for p in params for sym in p.symbols()}
    out: set[int] = set()
    for u in {side for u in arguments for side in _abs_sides(u, d)}:
        if not u.has(d) or u.free_symbols - {d} - set(symbols.values()):
            continue
        try:
            poly = sp.Poly(u, d)
        except sp.PolynomialError:
            continue
        if poly.degree() > 2:
            continue
        coefficients = [sp.lambdify(list(symbols.values()), c, modules="math")
                        for c in poly.all_coeffs()]
        for combo in combos:
            try:
                coeffs = [float(c(*[combo[name] for name in symbols])) for c in coefficients]
            except (ValueError, ZeroDivisionError, OverflowError, TypeError):
                continue
            for root in _real_roots(coeffs):
                if math.isfinite(root) and abs(root) <= 4 * MAX_POSITION:
                    base = math.floor(root)
                    out.update(base + o for o in (-1, 0, 1, 2))
    return out


MAX_ABS_SIDES = 3   # Abs(...) of d in one argument whose sides are searched (2**3 variants)


def _abs_sides(u: sp.Expr, d: sp.Symbol) -> list[sp.Expr]:
    """u, and u with each Abs(w) of d read as w or -w: a pole of 1/(Abs(d) - 5000) is a root of
    d - 5000 or -d - 5000, which Poly cannot see through the Abs (a causal-only prior reads d
    as Abs(d): every pole of its formula sits behind one)."""
    kinks = sorted({a for a in u.atoms(sp.Abs) if a.has(d)}, key=sp.default_sort_key)
    if not kinks or len(kinks) > MAX_ABS_SIDES:
        return [u]
    sides = [u]
    for signs in itertools.product((1, -1), repeat=len(kinks)):
        sides.append(u.xreplace({a: s * a.args[0] for a, s in zip(kinks, signs)}))
    return sides


def _real_roots(coeffs: list[float]) -> list[float]:
    if len(coeffs) == 2:
        a, b = coeffs
        return [-b / a] if a else []
    if len(coeffs) == 3:
        a, b, c = coeffs
        if not a:
            return [-c / b] if b else []
        disc = b * b - 4 * a * c
        if disc < 0:
            return []
        r = math.sqrt(disc)
        return [(-b - r) / (2 * a), (-b + r) / (2 * a)]
    return []


# --------------------------------------------------------------------------------------------
# the check

@dataclass(frozen=True)
class _Code:
    """One printed expression as a CodeBlock-like object (no hoisting, no temporaries)."""
    outputs: tuple[str, ...]
    hoisted: tuple = ()
    body: tuple = ()


def check_plan(plan, names: dict) -> None:
    """Raise a SpecError where the plan's printed code breaks somewhere in the domain (the
    rules are in the module docstring)."""
    ir, spec = plan.ir, plan.ir.spec
    params = [p for p in spec.params if not p.is_constant]
    log_prior = guarded(ir.log_prior, "the log-prior", value=True)
    exprs = [log_prior, ir.logit, *(g for _, g in ir.grads)]
    pos = position_symbols(spec.channels)
    # (with several channels, every channel takes the grid's values: d0 = d1 = d, ...)
    used = {n[0] for n in pos if any(e.has(pos[n]) for e in exprs)}
    lp_code = _Code((print_expr(prepare(log_prior, target="torch"), names, target="torch"),))
    checker = _Checker(plan, spec, lp_code, names)
    # the work is counted, not timed: a prior whose printed code is long scans fewer parameter
    # combinations (never fewer than MIN_COMBINATIONS), so a build's outcome never depends on
    # the machine's load
    operations = checker.operations()
    grid = _position_grid(used, set(), spec.causal_only)
    points = next(iter(grid.values())).numel()
    limit = max(MIN_COMBINATIONS, SCAN_OPERATIONS // max(points * operations, 1))
    combos = _combinations(params, limit)
    grid = _position_grid(used, _roots(exprs, params, combos), spec.causal_only)
    points = next(iter(grid.values())).numel()
    s = torch.tensor(SCORES, dtype=torch.float64)[torch.arange(points) % len(SCORES)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # small tensors: one thread beats an OpenMP team on a busy machine
    try:
        _scan_chunks(checker, combos, grid, s, points, operations, spec.channels)
    finally:
        torch.set_num_threads(threads)


def _scan_chunks(checker, combos, grid, s, points, operations, channels=1):
    # a chunk's temporaries (the printed code keeps each statement's value) stay a few 100 MB
    step = max(1, (CHUNK * 64 // max(operations, 64)) // max(points, 1))
    for start in range(0, len(combos), step):
        chunk = combos[start:start + step]
        inputs = {"s": s[None, :], **{f"pos_{k}": v[None, :] if channels == 1 or k == "n"
                                      else (v[None, :],) * channels for k, v in grid.items()}}
        for k in POSITION_SYMBOLS:
            inputs.setdefault(f"pos_{k}", None)
        for label, name in checker.kernel_name.items():
            value = torch.tensor([c[label] for c in chunk], dtype=torch.float64)[:, None]
            if name.endswith("]"):   # an element of a vector: the hooks hold a tuple, prm_w[3]
                inputs.setdefault(name.rpartition("[")[0], _Vector()).append(value)
            else:
                inputs[name] = value
        checker.run(inputs, grid, s, chunk, init=start == 0)


class _Checker:
    """Evaluates every printed block of a plan on one chunk of the grid and applies the rules."""

    def __init__(self, plan, spec, lp_code, names):
        self.plan, self.spec, self.lp_code = plan, spec, lp_code
        self.lp_field = "density" if spec.from_density else "log_prior"
        self.score_field = "score" if spec.score is not None else self.lp_field
        self.learnable = [name for name, _ in plan.ir.grads]
        symbols = runtime_symbols(spec)
        self.kernel_name = {label: names[sym] for label, sym in symbols.items()}
        in_prior = plan.ir.log_prior.free_symbols
        self.param_field = {name: self.lp_field if symbols[name] in in_prior else "score"
                            for name in self.learnable}
        self.table_name = dict(zip(plan.distance_table.grads, _table_entries(plan))) \
            if plan.distance_table is not None else {}
        # which parameters each checked expression reads, so that a message shows those first
        ir = plan.ir
        # (a derivative's key is ("d", label): a parameter may be called logit)
        exprs = {"log_prior": ir.log_prior, "logit": ir.logit, "dlogit_ds": ir.dlogit_ds,
                 **{("d", label): g for label, g in ir.grads}}
        self.reads = {key: frozenset(label for label, sym in symbols.items()
                                     if sym in expr.free_symbols) for key, expr in exprs.items()}
        # and which of the grid's coordinates (d, i, j, n, s), so that it names no other
        self.coordinates = _coordinates_by_expression(spec, exprs)

    def operations(self) -> int:
        """Printed statements run per grid point and parameter combination: the work of a
        scan, counted."""
        plan = self.plan
        blocks = [plan.torch_fwd, plan.torch_bwd, plan.triton_fwd, plan.triton_bwd]
        if plan.distance_table is not None:
            blocks.append(plan.distance_table.code)
        if plan.ramp is not None:
            blocks.append(plan.ramp)
        # the float64 and the float32 runs of each block, and the log-prior on its own
        return 2 + 2 * sum(len(b.hoisted) + len(b.body) + len(b.outputs) for b in blocks)

    def run(self, inputs, grid, s, chunk, init: bool):
        lp64 = run_block(self.lp_code, inputs, torch.float64, "torch")[0]
        lp32 = run_block(self.lp_code, inputs, torch.float32, "torch")[0]
        bwd64 = run_block(self.plan.torch_bwd, inputs, torch.float64, "torch")
        shape = torch.broadcast_shapes(lp64.shape, *(t.shape for t in bwd64),
                                       (len(chunk), next(iter(grid.values())).numel()))
        lp64, lp32 = lp64.expand(shape), lp32.expand(shape)
        z64, dlds64, *grads64 = (t.expand(shape) for t in bwd64)
        where = _Where(grid, s, chunk, self.plan.score_is_identity, self.reads, self.coordinates)

        # 1. the formula itself, in float64
        self._fail_if(torch.isnan(lp64), where, self.lp_field, "the log-prior is nan",
                      _NAN_HINT, reads="log_prior")
        self._fail_if(lp64 == math.inf, where, self.lp_field, "the log-prior is +inf",
                      _INF_HINT, reads="log_prior")
        if init and bool((lp64[0] == -math.inf).all()):
            raise SpecError("the prior is zero (log-prior -oo) at every position with the "
                            "initial parameters", field=self.lp_field,
                            hint="a prior must give some key a finite log-prior")
        # the score and the derivatives where the log-prior is an ordinary number: beyond
        # ORDINARY a score such as (s + log_prior) * t with t < 0 overflows float64 itself
        prior_ok = torch.isfinite(lp64) & (lp64.abs() <= ORDINARY)
        self._fail_if(prior_ok & (torch.isnan(z64) | (z64 == math.inf)), where,
                      self.score_field, "the logit is " + "nan or +inf", _NAN_HINT, reads="logit")
        logit_ok = prior_ok & torch.isfinite(z64)
        self._fail_if(logit_ok & ~torch.isfinite(dlds64), where, self.score_field,
                      "d logit / d s is not finite", _NAN_HINT, reads="dlogit_ds")
        for name, g in zip(self.learnable, grads64):
            self._fail_if(logit_ok & torch.isnan(g), where, self.param_field[name],
                          f"the derivative in {name} is nan", _NAN_HINT, reads=("d", name))

        # 2. what the kernels compute, in float32, against the float64 values
        moderate = logit_ok & (z64 > -MODERATE) & (lp64 > -MODERATE)
        if not (self.plan.ir.distance_only and self.plan.score_is_identity):
            self._compare32(lp32.expand(shape), lp64, where, self.lp_field, "the log-prior",
                            "the CPU path (float32)", reads="log_prior")
        for target, blocks in self._float32_blocks(inputs):
            for label, value in blocks:
                value = value.expand(shape)
                if label == "log_prior":
                    self._compare32(value, lp64, where, self.lp_field, "the log-prior", target,
                                    reads="log_prior")
                elif label == "logit":
                    # where the float32 log-prior is -inf the key has no weight whatever the
                    # score makes of it (the log-prior itself was compared above)
                    self._compare32(value, z64, where, self.score_field, "the logit", target,
                                    mask=prior_ok & torch.isfinite(lp32), reads="logit")
                elif label == "ramp":
                    self._fail_if(moderate & torch.isnan(value), where, self.lp_field,
                                  f"in {target} the causal ramp of the log-prior is nan", _F32_HINT,
                                  reads="log_prior")
                elif label == "dlogit_ds":
                    self._fail_if(moderate & ~torch.isfinite(value), where, self.score_field,
                                  f"in {target} d logit / d s is not finite",
                                  _F32_HINT, reads="dlogit_ds")
                else:
                    self._fail_if(moderate & torch.isnan(value), where, self.param_field[label],
                                  f"in {target} the derivative in {label} is nan",
                                  _F32_HINT, reads=("d", label))

    def _float32_blocks(self, inputs):
        """(where, [(label, value)]) for every printed block the module runs, as it runs it:
        the CPU path's per-score code in float32 (unless the logit is s + f(d), which it reads
        from the distance table); the distance table in float64 on the host; the GPU kernels'
        code in float32, per score (inline) or over the table's float32 entries (table)."""
        plan = self.plan
        f32 = torch.float32
        labels_bwd = ["logit", "dlogit_ds"] + self.learnable
        if not (plan.ir.distance_only and plan.score_is_identity):
            yield "the CPU path (float32)", list(zip(["logit"], run_block(plan.torch_fwd, inputs, f32, "torch")))
            yield "the CPU path (float32)", list(zip(labels_bwd, run_block(plan.torch_bwd, inputs, f32, "torch")))
        gpu_inputs = dict(inputs)
        if plan.distance_table is not None:
            entries = run_block(plan.distance_table.code, inputs, torch.float64, "torch")
            value, grads = entries[0], entries[1:]
            live = value > -math.inf
            gpu_inputs["tab_v"] = value.to(f32)
            for name, g in zip(plan.distance_table.grads, grads):
                g = torch.where(live, g, torch.zeros((), dtype=g.dtype))
                gpu_inputs[self.table_name[name]] = g.clamp(-FLOAT32_MAX, FLOAT32_MAX).to(f32)
            yield "the distance table (float64)", ([("log_prior", value)]
                                                   + list(zip(plan.distance_table.grads, grads)))
        if plan.ramp is not None:
            slope, intercept, *slope_grads = run_block(plan.ramp, inputs, f32, "triton")
            yield "the GPU kernels (float32)", ([("ramp", slope), ("ramp", intercept)]
                                                + list(zip(self.learnable, slope_grads)))
        fwd = run_block(plan.triton_fwd, gpu_inputs, f32, "triton")
        bwd = run_block(plan.triton_bwd, gpu_inputs, f32, "triton")
        if plan.score_is_identity:
            yield "the GPU kernels (float32)", list(zip(["log_prior"] if plan.table is None else [], fwd))
            yield "the GPU kernels (float32)", list(zip(self.learnable, bwd))
        else:
            yield "the GPU kernels (float32)", list(zip(["logit"], fwd)) + list(zip(labels_bwd, bwd))

    def _compare32(self, v32, v64, where, field, what, target, mask=None, reads=None):
        """Rule 3: NaN or +inf where float64 is not, -inf where it is moderate."""
        ok = ~torch.isnan(v64) if mask is None else mask & ~torch.isnan(v64)
        self._fail_if(ok & torch.isnan(v32), where, field,
                      f"in {target} {what} is nan", _F32_HINT, v64, reads)
        self._fail_if(ok & (v32 == math.inf) & (v64 < math.inf), where, field,
                      f"in {target} {what} is +inf", _F32_HINT, v64, reads)
        self._fail_if(ok & (v32 == -math.inf) & (v64 > -MODERATE), where, field,
                      f"in {target} {what} is -inf", _F32_HINT, v64, reads)

    def _fail_if(self, bad, where, field, message, hint, exact=None, reads=None):
        """Raise the SpecError of the first point where ``bad`` holds; reads: the key in
        self.reads of the expression that failed (its parameters lead the point's)."""
        if not bool(bad.any()):
            return
        c, k = (int(x) for x in torch.nonzero(bad)[0])
        detail = "" if exact is None else f" where its value is {float(exact[c, k]):.6g}"
        if self.spec.channels == 1 and where.only_after_query(bad):
            hint += _CAUSAL_HINT
        point = where.point(c, k, reads)
        hint += _domain_hint(self.spec, point, where.reads.get(reads, frozenset()))
        raise SpecError(f"{message} at {point}{detail}", field=field, hint=hint)


def _domain_hint(spec, point: Point, read) -> str:
    """A parameter of the domain real (the default) that the failing expression reads and that
    is 0 at the failing point: most often a scale or a rate declared without its domain
    (-Abs(d)/b with b real is nan at b = 0), so say how to declare it."""
    real = {label: sym for p in spec.params if p.domain.kind == "real" and not p.is_constant
            for label, sym in zip(p.labels(), p.symbols())}
    exprs = [spec.log_prior] + ([spec.score] if spec.score is not None else [])
    zero = [label for label, v in point.values
            if label in real and label in read and v == 0
            and any(_divides_or_logs(e, real[label]) for e in exprs)]
    if not zero:
        return ""
    label = zero[0]
    name = label.partition("[")[0]
    return (f"; {label} = 0 is in the domain of {name}, real (the default): if {name} must not "
            f"be 0, declare its domain: positive, nonnegative or an interval [lo, hi]")


def _divides_or_logs(expr: sp.Expr, sym: sp.Symbol) -> bool:
    """Whether ``sym`` is in a denominator (a base with a negative exponent) or under a log
    in ``expr``: where its value 0 makes the formula nan or infinite."""
    return any(sym in e.free_symbols for e in expr.atoms(sp.log)) or any(
        sym in e.base.free_symbols and e.exp.is_negative for e in expr.atoms(sp.Pow))


def _coordinates_by_expression(spec, exprs: dict) -> dict:
    """{key: the grid coordinates the expression exprs[key] reads} (_coordinates_read)."""
    positions = position_symbols(spec.channels)
    coordinates = {S: "s", **{sym: name[0] for name, sym in positions.items()}}   # d0 -> d
    formulas = [e for e in (spec.log_prior, spec.score) if e is not None]
    written = _coordinates_read(sp.Tuple(*formulas), coordinates, set())
    return {key: _coordinates_read(expr, coordinates, written) for key, expr in exprs.items()}


def _coordinates_read(expr: sp.Expr, coordinates: dict, written: set[str]) -> frozenset[str]:
    """The grid coordinates (d, i, j, n, s: {symbol: its coordinate} in ``coordinates``, every
    channel's d_c a d) that ``expr`` reads. The compiler holds i as d + j
    (symbolic._canonical_positions), so i counts as read where the file writes it and the
    expression reads d and j."""
    read = {coordinates[sym] for sym in expr.free_symbols if sym in coordinates}
    if "i" in written and {"d", "j"} <= read:
        read.add("i")
    return frozenset(read)


def _table_entries(plan) -> list[str]:
    """The kernel names (tab_<stem>) of the distance table's derivative entries, in order."""
    stems = {label: stem for p in plan.params for label, stem in zip(
        (p.name,) if p.size is None else [f"{p.name}[{k}]" for k in range(p.size)], p.idents)}
    return [f"tab_{stems[label]}" for label in plan.distance_table.grads]


class _Where:
    """Names the grid point (c, k): combination c of the parameters, position k. reads:
    {expression: the labels of the parameters it reads} (_Checker.reads)."""

    def __init__(self, grid, s, chunk, identity, reads=None, coordinates=None):
        self.grid, self.s, self.chunk, self.identity = grid, s, chunk, identity
        self.reads = reads or {}
        self.coordinates = coordinates or {}

    def only_after_query(self, bad) -> bool:
        """Every bad point has its key after its query (d < 0), where a causal-only prior is
        never read."""
        return not bool(bad[:, self.grid["d"] >= 0].any())

    def point(self, c: int, k: int, reads=None) -> Point:
        """The positions, the score and the parameters of point (c, k): every parameter the
        failing expression ``reads`` (so the point can be rebuilt from the message, FIRE's 99
        scalars included), then the others up to MAX_SHOWN in all. Of the positions and the
        score, those it reads: a distance the formula never reads would only mislead."""
        values = [(name, float(v[k])) for name, v in self.grid.items()]
        if not self.identity:
            values.append(("s", float(self.s[k])))
        coordinates = self.coordinates.get(reads)
        if coordinates is not None:
            values = [(name, v) for name, v in values if name in coordinates]
        read = self.reads.get(reads, frozenset())
        params = list(self.chunk[c].items())
        first = [(label, v) for label, v in params if label in read]
        rest = [(label, v) for label, v in params if label not in read]
        shown = first + rest[:max(0, MAX_SHOWN - len(first))]
        values += shown + ([("...", math.nan)] if len(shown) < len(params) else [])
        return Point(tuple(values))


_NAN_HINT = ("the formula must be a real number for every distance |d| <= 2**25, position "
             "|i|, |j| <= 2**24 and parameter value in its domain: guard logs and fractional "
             "powers (log(1 + Abs(x)), Abs(x)**b), avoid poles, or split the cases with Piecewise")
_CAUSAL_HINT = ("; if the prior is for causal attention only, say so with causal_only: true, "
                "and it is checked at d >= 0 alone")
_INF_HINT = ("a log-prior may be -oo (a zero of the prior) but never +inf: a pole, or a "
             "growth without bound; bound it, e.g. Min(..., 1e4)")
_F32_HINT = ("the kernels compute in float32 (1.2e-38 to 3.4e38): an intermediate value leaves "
             "that range where the result does not; rewrite the formula so it does not, e.g. "
             "-log(1 + exp(x)) as -Max(x, 0) - log(1 + exp(-Abs(x)))")
