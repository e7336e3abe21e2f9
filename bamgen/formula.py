"""Formulas from prior files, parsed without ``eval``.

``sympy.sympify`` and ``parse_expr`` evaluate Python code, so a prior file could run anything.
Here a formula goes through Python's :mod:`ast` parser and is rebuilt node by node into SymPy,
admitting only a whitelist: numbers, the symbols the caller declares, the functions of
:data:`FUNCTIONS`, ``+ - * / **``, unary minus, and comparisons / ``&`` / ``|`` inside
``Piecewise``. Sizes are bounded so that no formula can make SymPy work for long: text length,
nesting depth, literal magnitude and constant powers.
"""
from __future__ import annotations

import ast
import math
from typing import Mapping

import sympy as sp

from .errors import SpecError

MAX_FORMULA_CHARS = 2000
MAX_DEPTH = 32
MAX_LITERAL = 1e12
MAX_CONST_EXPONENT = 64
MAX_SYMBOLIC_EXPONENT = 1000

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
        text = repr(text)
    if not text.strip():
        raise fail("the formula is empty", "write an expression such as '-Abs(d)/b'")
    if len(text) > MAX_FORMULA_CHARS:
        raise fail(f"the formula is {len(text)} characters long; the limit is {MAX_FORMULA_CHARS}")
    if "\x00" in text:
        raise fail("the formula contains a NUL byte")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise fail(f"cannot parse {text.strip()!r}: {exc.msg}",
                   "use Python/SymPy syntax, e.g. -(Abs(d - mu)/alpha)**beta") from None
    builder = _Builder(symbols, fail)
    expr = builder.build(tree.body, depth=0)
    builder._require_expr(expr)
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
        return method(node, depth + 1)

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
            parts.append(rel(a, b))
        return parts[0] if len(parts) == 1 else sp.And(*parts)

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
        args = [self.build(a, depth) for a in node.args]
        for a in args:
            self._require_expr(a)
        arity = {"Min": None, "Max": None}.get(name, 1)
        if arity is not None and len(args) != arity:
            raise self.fail(f"{name} takes {arity} argument, got {len(args)}")
        if arity is None and len(args) < 2:
            raise self.fail(f"{name} takes at least 2 arguments, got {len(args)}")
        return FUNCTIONS[name](*args)

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
        if pieces[-1][1] is not sp.true:
            raise self.fail("the last Piecewise pair must have the condition True",
                            "end with (value, True) so every position has a value")
        return sp.Piecewise(*pieces)

    def _require_expr(self, value):
        if _is_condition(value) or not isinstance(value, sp.Expr):
            raise self.fail("a condition was used where a number is expected",
                            "conditions belong only inside Piecewise((value, condition), ...)")


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
             "Await": "await", "Yield": "yield"}
    return names.get(type(node).__name__, type(node).__name__)
