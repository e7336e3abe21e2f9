"""Formulas from prior files, parsed without ``eval``.

``sympy.sympify`` and ``parse_expr`` evaluate Python code, so a prior file could run anything.
Here a formula goes through Python's :mod:`ast` parser and is rebuilt node by node into SymPy,
admitting only a whitelist: numbers, the symbols the caller declares, the functions of
:data:`FUNCTIONS`, ``+ - * / **``, unary minus, and comparisons / ``&`` / ``|`` inside
``Piecewise``. Sizes are bounded so that no formula can make SymPy work for long: text length,
nesting depth, literal magnitude, constant powers, the degree that nested powers multiply to, and
every constant must fit in a float. :func:`evaluate` computes a formula in float64, as a kernel
would, and refuses what SymPy's exact arithmetic could only do with astronomically large numbers.
"""
from __future__ import annotations

import ast
import math
import warnings
from typing import Mapping

import sympy as sp

from ..errors import SpecError

MAX_FORMULA_CHARS = 2000
MAX_DEPTH = 32
MAX_LITERAL = 1e12
MAX_CONST_EXPONENT = 64
MAX_SYMBOLIC_EXPONENT = 1000
MAX_DEGREE = 1000   # nested constant powers multiply: ((d**10 + 1)**10 + 1)**10 has degree 1000
MAX_MINMAX_ARGS = 8    # Min/Max arguments (after SymPy flattens nested ones): each derivative of
                       # Max(a1..an) holds n*(n-1) Heaviside factors
MAX_PIECES = 16        # Piecewise pairs: each is one more nested where() in the printed code
MAX_TREE = 20_000      # nodes of any expression's tree, as SymPy's own walks (xreplace, has,
                       # the constructors' checks) visit it; the shipped priors' largest has 40
# Functions of constants that SymPy would settle exactly (floor(exp(700)) needs 300 digits, the
# sign of a difference of two equal constants may never be decided): computed in float64
# instead, as the kernel computes them.
FOLDED = ("floor", "ceiling", "sign", "Abs", "Min", "Max")

FUNCTIONS: Mapping[str, object] = {
    "exp": sp.exp, "log": sp.log, "sqrt": sp.sqrt, "Abs": sp.Abs, "sign": sp.sign,
    "Min": sp.Min, "Max": sp.Max, "sinh": sp.sinh, "cosh": sp.cosh, "tanh": sp.tanh,
    "atan": sp.atan, "Piecewise": sp.Piecewise, "floor": sp.floor, "ceiling": sp.ceiling,
    "erf": sp.erf,
}
CONSTANTS: Mapping[str, sp.Expr] = {"pi": sp.pi, "E": sp.E, "oo": sp.oo}
RESERVED = frozenset(FUNCTIONS) | frozenset(CONSTANTS) | {"True", "False"}

_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}
_COMPARE = {ast.Lt: sp.Lt, ast.LtE: sp.Le, ast.Gt: sp.Gt, ast.GtE: sp.Ge,
            ast.Eq: sp.Eq, ast.NotEq: sp.Ne}


def parse_formula(text: object, symbols: Mapping[str, sp.Symbol], *, field: str,
                  line: int | None = None) -> sp.Expr:
    """Parse ``text`` into a SymPy expression over ``symbols``; raise SpecError on anything else."""
    def fail(msg: str, hint: str | None = None) -> SpecError:
        return SpecError(msg, field=field, line=line, hint=hint)

    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise fail(f"expected a formula (a string or a number), got {type(text).__name__}",
                   "write the formula as a quoted string")
    if isinstance(text, (int, float)):
        if isinstance(text, int) and abs(text) > MAX_LITERAL:   # before repr: 10**5000 has none
            raise fail(f"the number ({text.bit_length()} bits) is larger than {MAX_LITERAL:g}")
        if isinstance(text, float) and not (math.isfinite(text) and abs(text) <= MAX_LITERAL):
            raise fail(f"the number {text!r} is not finite or larger than {MAX_LITERAL:g}")
        text = repr(text)
    if not text.strip():
        raise fail("the formula is empty", "write an expression such as '-Abs(d)/b'")
    if len(text) > MAX_FORMULA_CHARS:
        raise fail(f"the formula is {len(text)} characters long; the limit is {MAX_FORMULA_CHARS}")
    if "\x00" in text:
        raise fail("the formula contains a NUL byte")
    if "#" in text or "\\" in text:
        # The text is copied into the generated module's docstrings: no comments, no escapes.
        raise fail("comments ('#') and backslashes are not allowed in a formula",
                   "put remarks in 'description'")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # SyntaxWarnings would print a second line
            tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise fail(f"cannot parse {text.strip()!r}: {exc.msg}",
                   "use Python/SymPy syntax, e.g. -(Abs(d - mu)/alpha)**beta") from None
    except (RecursionError, MemoryError):
        raise fail("the formula is nested too deeply to parse", "simplify the expression") from None
    builder = _Builder(symbols, fail)
    try:
        expr = builder.build(tree.body, depth=0)
    except (ArithmeticError, TypeError, ValueError) as exc:
        if isinstance(exc, SpecError):
            raise
        # SymPy gave up on exact arithmetic (PrecisionExhausted, an undecidable comparison)
        raise fail(f"the formula cannot be computed ({type(exc).__name__}: {str(exc)[:80]})",
                   "keep constants moderate; compare and round expressions of the positions, "
                   "not of large constants") from None
    builder._require_expr(expr)
    _check_minmax(expr, fail)
    degree = _degree(expr, {})
    if degree > MAX_DEGREE:
        raise fail(f"the powers in the formula multiply to degree {degree:g}; the limit is {MAX_DEGREE}",
                   "nested powers such as (d**100)**100 are refused")
    return expr


class _Builder:
    """Rebuilds a whitelisted Python AST as a SymPy expression."""

    def __init__(self, symbols: Mapping[str, sp.Symbol], fail):
        self.symbols = symbols
        self.fail = fail

    def build(self, node: ast.AST, depth: int):
        if depth > MAX_DEPTH:
            raise self.fail(f"the formula is nested deeper than {MAX_DEPTH} levels",
                            "simplify the expression")
        method = getattr(self, "_" + type(node).__name__, None)
        if method is None:
            raise self.fail(f"{_describe(node)} is not allowed in a formula",
                            "only numbers, declared symbols, + - * / **, and the functions "
                            + ", ".join(sorted(FUNCTIONS)) + " are allowed")
        result = method(node, depth + 1)
        if isinstance(result, sp.Expr) and result.is_number:
            self._check_constant(result)
        return result

    def _check_constant(self, value: sp.Expr) -> None:
        """A constant must fit in a float before anything is built on it: SymPy evaluates
        constants exactly, and exp(exp(exp(exp(5.0)))) or floor of it would never finish."""
        try:
            x = evaluate(value, {})
        except OverflowError as exc:
            raise self.fail(f"the constant {_short(value)} cannot be computed: {exc}") from None
        if math.isinf(x) and not value.has(sp.oo, sp.S.NegativeInfinity, sp.zoo):
            raise self.fail(f"the constant {_short(value)} overflows a float",
                            "constants must lie within about 1e308")

    def _Constant(self, node: ast.Constant, depth: int):
        value = node.value
        if isinstance(value, bool):
            return sp.true if value else sp.false
        if isinstance(value, int):
            if abs(value) > MAX_LITERAL:
                raise self.fail(f"the number {value} is larger than {MAX_LITERAL:g}")
            return sp.Integer(value)
        if isinstance(value, float):
            if not math.isfinite(value) or abs(value) > MAX_LITERAL:
                raise self.fail(f"the number {value!r} is not finite or larger than {MAX_LITERAL:g}")
            return sp.Float(repr(value))
        raise self.fail(f"the constant {value!r} is not a number")

    def _Name(self, node: ast.Name, depth: int):
        name = node.id
        if name.startswith("_"):
            raise self.fail(f"the name '{name}' is not allowed (names may not start with '_')")
        if name in self.symbols:
            return self.symbols[name]
        if name in CONSTANTS:
            return CONSTANTS[name]
        if name in ("True", "False"):
            return sp.true if name == "True" else sp.false
        if name in FUNCTIONS:
            raise self.fail(f"the function '{name}' must be called, e.g. {name}(d)")
        known = ", ".join(sorted(self.symbols)) or "none"
        raise self.fail(f"unknown symbol '{name}'",
                        f"symbols allowed here: {known}; declare parameters under 'params'")

    def _UnaryOp(self, node: ast.UnaryOp, depth: int):
        operand = self.build(node.operand, depth)
        if isinstance(node.op, ast.USub):
            return -operand
        if isinstance(node.op, ast.UAdd):
            return operand
        raise self.fail(f"the operator {type(node.op).__name__} is not allowed")

    def _BinOp(self, node: ast.BinOp, depth: int):
        left = self.build(node.left, depth)
        right = self.build(node.right, depth)
        if isinstance(node.op, ast.Pow):
            return self._power(left, right)
        if isinstance(node.op, (ast.BitAnd, ast.BitOr)):
            combine = sp.And if isinstance(node.op, ast.BitAnd) else sp.Or
            if not (_is_condition(left) and _is_condition(right)):
                raise self.fail("'&' and '|' join conditions, e.g. (d >= 0) & (d < 64)")
            return combine(left, right)
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise self.fail(f"the operator {type(node.op).__name__} is not allowed",
                            "use + - * / ** only")
        self._require_expr(left)
        self._require_expr(right)
        return op(left, right)

    def _power(self, base, exponent):
        self._require_expr(base)
        self._require_expr(exponent)
        if exponent.is_Number:
            limit = MAX_CONST_EXPONENT if base.is_Number else MAX_SYMBOLIC_EXPONENT
            if abs(float(exponent)) > limit:
                raise self.fail(f"the exponent {exponent} is too large (limit {limit})")
            if base.is_Number and float(exponent) > 0 and abs(float(base)) > 1:
                if abs(float(exponent)) * math.log10(abs(float(base))) > 300:
                    raise self.fail(f"{base}**{exponent} overflows a float")
        return sp.Pow(base, exponent)

    def _BoolOp(self, node: ast.BoolOp, depth: int):
        values = [self.build(v, depth) for v in node.values]
        return sp.And(*values) if isinstance(node.op, ast.And) else sp.Or(*values)

    def _Compare(self, node: ast.Compare, depth: int):
        terms = [self.build(node.left, depth)] + [self.build(c, depth) for c in node.comparators]
        parts = []
        for op, a, b in zip(node.ops, terms, terms[1:]):
            rel = _COMPARE.get(type(op))
            if rel is None:
                raise self.fail(f"the comparison {type(op).__name__} is not allowed")
            self._require_expr(a)
            self._require_expr(b)
            if a.is_number and b.is_number:   # as the kernel would: in floating point
                parts.append(sp.true if self._compare_numbers(rel, a, b) else sp.false)
            else:
                parts.append(rel(a, b))
        return parts[0] if len(parts) == 1 else sp.And(*parts)

    def _compare_numbers(self, rel, a, b) -> bool:
        """Two constants compared: exactly when both are plain numbers, else in float64, and
        refused where float64 cannot tell them apart (SymPy might search for ever)."""
        if a.is_Number and b.is_Number:
            return bool(rel(a, b))
        x, y = evaluate(a, {}), evaluate(b, {})
        if x == y or math.isnan(x) or math.isnan(y):
            raise self.fail(f"the comparison of the constants {_short(a)} and {_short(b)} cannot "
                            f"be decided in floating point (both are {x!r})",
                            "compare expressions of the positions, or write the numbers out")
        return {sp.Lt: x < y, sp.Le: x <= y, sp.Gt: x > y, sp.Ge: x >= y,
                sp.Eq: x == y, sp.Ne: x != y}[rel]

    def _Call(self, node: ast.Call, depth: int):
        if not isinstance(node.func, ast.Name):
            raise self.fail(f"{_describe(node.func)} cannot be called",
                            "call a whitelisted function by name, e.g. exp(-d)")
        name = node.func.id
        if name not in FUNCTIONS:
            raise self.fail(f"unknown function '{name}'",
                            "allowed functions: " + ", ".join(sorted(FUNCTIONS)))
        if node.keywords:
            raise self.fail(f"keyword arguments are not allowed in {name}(...)")
        if name == "Piecewise":
            return self._piecewise(node, depth)
        if name in ("Min", "Max") and _flat_arity(node, name) > MAX_MINMAX_ARGS:
            # from the text, before any nested call is built (each compares its arguments)
            raise self.fail(f"{name} takes at most {MAX_MINMAX_ARGS} arguments (nested {name} "
                            f"calls merged), got {_flat_arity(node, name)}",
                            "split the list, or combine the terms with Piecewise")
        args = [self.build(a, depth) for a in node.args]
        for a in args:
            self._require_expr(a)
        arity = {"Min": None, "Max": None}.get(name, 1)
        if arity is not None and len(args) != arity:
            raise self.fail(f"{name} takes {arity} argument, got {len(args)}")
        if arity is None and len(args) < 2:
            raise self.fail(f"{name} takes at least 2 arguments, got {len(args)}")
        flat = sum(len(a.args) if a.func is FUNCTIONS[name] else 1 for a in args)
        if arity is None and flat > MAX_MINMAX_ARGS:
            # before SymPy sees them: Max compares its arguments pairwise, symbolically
            raise self.fail(f"{name} takes at most {MAX_MINMAX_ARGS} arguments (nested {name} "
                            f"calls merged), got {flat}",
                            "split the list, or combine the terms with Piecewise")
        if name in FOLDED and all(a.is_number for a in args):
            return self._fold(FUNCTIONS[name](*args, evaluate=False))
        return FUNCTIONS[name](*args)

    def _fold(self, call: sp.Expr) -> sp.Expr:
        """A call of a FOLDED function on constants, computed in float64."""
        try:
            value = evaluate(call, {})
        except OverflowError as exc:
            raise self.fail(f"the constant {_short(call)} cannot be computed: {exc}") from None
        if math.isnan(value):
            raise self.fail(f"the constant {_short(call)} is not a number")
        if math.isinf(value):
            return sp.oo if value > 0 else sp.S.NegativeInfinity
        if value.is_integer() and abs(value) <= 2 ** 53:
            return sp.Integer(int(value))
        return sp.Float(repr(value))

    def _piecewise(self, node: ast.Call, depth: int):
        pieces = []
        for arg in node.args:
            if not isinstance(arg, ast.Tuple) or len(arg.elts) != 2:
                raise self.fail("Piecewise takes (value, condition) pairs",
                                "e.g. Piecewise((-d/8, d < 64), (-oo, True))")
            value = self.build(arg.elts[0], depth)
            cond = self.build(arg.elts[1], depth)
            self._require_expr(value)
            if not _is_condition(cond):
                raise self.fail("the second item of a Piecewise pair must be a condition")
            pieces.append((value, cond))
        if not pieces:
            raise self.fail("Piecewise needs at least one (value, condition) pair")
        if len(pieces) > MAX_PIECES:
            raise self.fail(f"Piecewise takes at most {MAX_PIECES} pairs, got {len(pieces)}",
                            "nest a Piecewise inside a value, or simplify the cases")
        if pieces[-1][1] is not sp.true:
            raise self.fail("the last Piecewise pair must have the condition True",
                            "end with (value, True) so every position has a value")
        return sp.Piecewise(*pieces)

    def _require_expr(self, value):
        if _is_condition(value) or not isinstance(value, sp.Expr):
            raise self.fail("a condition was used where a number is expected",
                            "conditions belong only inside Piecewise((value, condition), ...)")


def _flat_arity(call: ast.Call, name: str) -> int:
    """Arguments of a Min or Max call once SymPy merges the nested calls of the same name."""
    return sum(_flat_arity(a, name) if isinstance(a, ast.Call) and isinstance(a.func, ast.Name)
               and a.func.id == name else 1 for a in call.args)


def tree_size(expr: sp.Basic, memo: dict) -> int:
    """Nodes of the tree ``expr`` stands for (a shared sub-expression counts at every use),
    saturating at MAX_TREE + 1; ``memo`` caches per node, so the cost is the DAG's."""
    n = memo.get(expr)
    if n is None:
        n = 1
        for a in expr.args:
            n += tree_size(a, memo)
            if n > MAX_TREE:
                break
        memo[expr] = n = min(n, MAX_TREE + 1)
    return n


def _check_minmax(expr: sp.Basic, fail) -> None:
    """SymPy flattens Max(Max(a, b), Max(c, d)) into Max(a, b, c, d): bound the result too."""
    for node in unique_nodes(expr):
        if isinstance(node, (sp.Min, sp.Max)) and len(node.args) > MAX_MINMAX_ARGS:
            raise fail(f"{type(node).__name__} has {len(node.args)} arguments once nested calls "
                       f"are merged; the limit is {MAX_MINMAX_ARGS}",
                       "split the list, or combine the terms with Piecewise")


def unique_nodes(expr: sp.Basic):
    """Every distinct sub-expression once (a shared sub-tree is not walked twice)."""
    seen, stack = set(), [expr]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(node.args)


def _is_condition(value) -> bool:
    """True for comparisons, &/| and True/False (a Symbol is also a sympy Boolean: not that)."""
    return isinstance(value, (sp.core.relational.Relational, sp.logic.boolalg.BooleanFunction,
                              sp.logic.boolalg.BooleanAtom))


def _describe(node: ast.AST) -> str:
    names = {"Attribute": "attribute access", "Lambda": "a lambda", "ListComp": "a comprehension",
             "GeneratorExp": "a generator", "DictComp": "a comprehension",
             "SetComp": "a comprehension", "Subscript": "indexing", "List": "a list",
             "Dict": "a dict", "Set": "a set", "Tuple": "a tuple", "IfExp": "an if-expression",
             "JoinedStr": "an f-string", "Starred": "unpacking", "NamedExpr": "':='",
             "Await": "await", "Yield": "yield", "Constant": "a constant"}
    return names.get(type(node).__name__, type(node).__name__)


def _short(value: sp.Expr, limit: int = 40) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit - 12] + "..." + text[-9:]


def _degree(expr: sp.Basic, memo: dict) -> float:
    """How large a power of a position SymPy's exact arithmetic may build: the product of the
    constant exponents along a path (a product adds its factors' degrees)."""
    if expr in memo:
        return memo[expr]
    if expr.is_Atom:
        degree = 0.0 if expr.is_number else 1.0
    elif expr.is_Pow and expr.exp.is_Number:
        degree = _degree(expr.base, memo) * max(1.0, abs(float(expr.exp)))
    elif expr.is_Mul:
        degree = sum(_degree(a, memo) for a in expr.args)
    else:
        degree = max((_degree(a, memo) for a in expr.args), default=0.0)
    memo[expr] = degree
    return degree


def evaluate(expr: sp.Basic, values: Mapping[sp.Symbol, float]) -> float:
    """``expr`` in float64 at ``values``, as a kernel computes it: an overflow gives ±inf, an
    invalid operation (log of a negative number, 0/0) gives nan.

    Raises OverflowError where SymPy, which computes exactly, would have to carry an
    astronomically large number: a value that overflowed fed to exp, sinh, cosh, tanh, erf, atan,
    floor or ceiling, used as an exponent, or a power with a non-constant exponent that overflows
    (exp(exp(exp(d))) at d = 40, d**d**d). Only ``oo`` written in the formula is a true infinity.
    """
    return _Evaluator(values).value(expr)[0]


_UNARY = {
    sp.exp: math.exp, sp.sinh: math.sinh, sp.cosh: math.cosh, sp.tanh: math.tanh,
    sp.erf: math.erf, sp.atan: math.atan,
    sp.floor: lambda x: float(math.floor(x)), sp.ceiling: lambda x: float(math.ceil(x)),
}


class _Evaluator:
    """Walks a SymPy expression in floats; each value carries whether it overflowed."""

    def __init__(self, values: Mapping[sp.Symbol, float]):
        self.values = values

    def value(self, e) -> tuple[float, bool]:
        if e in self.values:
            return float(self.values[e]), False
        if e.is_Atom:
            try:
                x = float(e)
            except (TypeError, ValueError):   # I, zoo, an unbound symbol
                return math.nan, False
            return x, math.isinf(x) and e not in (sp.oo, sp.S.NegativeInfinity)
        args = [self.value(a) for a in e.args] if not isinstance(e, sp.Piecewise) else []
        xs = [x for x, _ in args]
        if e.is_Add:
            return self._out(sum(xs), args)
        if e.is_Mul:
            return self._out(math.prod(xs), args)
        if e.is_Pow:
            return self._pow(e, args)
        if e.func in _UNARY:
            (x, big), = args
            if big:
                raise OverflowError(f"{e.func.__name__}() of a value that overflows a float")
            try:
                y = _UNARY[e.func](x)
            except OverflowError:   # exp, sinh, cosh of a large number; floor or ceiling of ±inf
                y = (x if e.func in (sp.floor, sp.ceiling)
                     else math.inf if e.func is sp.cosh else math.copysign(math.inf, x))
            except ValueError:      # floor or ceiling of nan
                y = math.nan
            return self._out(y, args)
        if e.func is sp.log:   # log(0) = -inf is exact, not an overflow
            (x, big), = args
            return (math.nan if not x >= 0 else -math.inf if x == 0 else math.log(x)), big
        if e.func is sp.Abs:
            return self._out(abs(xs[0]), args)
        if e.func is sp.sign:
            x = xs[0]
            return (x if math.isnan(x) else float((x > 0) - (x < 0))), False
        if e.func in (sp.Min, sp.Max):
            y = math.nan if any(map(math.isnan, xs)) else (min if e.func is sp.Min else max)(xs)
            return self._out(y, args)
        if isinstance(e, sp.Piecewise):
            chosen = None
            for piece, cond in e.args:   # every branch, as SymPy substitutes into every branch
                y = self.value(piece)
                if self.condition(cond) and chosen is None:
                    chosen = y
            return chosen if chosen is not None else (math.nan, False)
        if any(big for _, big in args):
            raise OverflowError(f"{e.func.__name__}() of a value that overflows a float")
        try:   # not met in practice: SymPy, on arguments that fit in a float
            return float(e.func(*[sp.Float(x) for x in xs]).evalf()), False
        except (TypeError, ValueError, OverflowError):
            return math.nan, False

    def _pow(self, e: sp.Pow, args) -> tuple[float, bool]:
        (b, big_b), (x, big_x) = args
        if big_x:
            raise OverflowError("a power whose exponent overflows a float")
        try:
            y = math.pow(b, x)
        except OverflowError:
            odd = x.is_integer() and x % 2 == 1
            y = -math.inf if b < 0 and odd else math.inf
        except ValueError:          # 0 ** negative (exact: a division by zero), negative ** fraction
            return (math.inf if b == 0 else math.nan), big_b
        result = self._out(y, args)
        if result[1] and not e.exp.is_Number:
            raise OverflowError("a power with a non-constant exponent overflows a float")
        return result

    def condition(self, c) -> bool:
        if c is sp.true or c is sp.false:
            return bool(c)
        if isinstance(c, sp.core.relational.Relational):
            a, b = self.value(c.lhs)[0], self.value(c.rhs)[0]
            return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b,
                    "==": a == b, "!=": a != b}[c.rel_op]
        parts = [self.condition(a) for a in c.args]
        if isinstance(c, sp.And):
            return all(parts)
        if isinstance(c, sp.Or):
            return any(parts)
        if isinstance(c, sp.Not):
            return not parts[0]
        return False

    @staticmethod
    def _out(y: float, args) -> tuple[float, bool]:
        """A result overflowed when it is infinite and not made only of true infinities."""
        xs = [x for x, _ in args]
        return y, math.isinf(y) and (any(big for _, big in args) or all(map(math.isfinite, xs)))
