"""Formulas from prior files, parsed without ``eval``.

``sympy.sympify`` and ``parse_expr`` evaluate Python code, so a prior file could run anything.
Here a formula goes through Python's :mod:`ast` parser and is rebuilt node by node into SymPy,
admitting only a whitelist: numbers, the symbols the caller declares, the functions of
:data:`FUNCTIONS`, ``+ - * / **``, unary minus, comparisons / ``&`` / ``|`` inside
``Piecewise``, an element of a vector parameter ``w[e]`` (:class:`Gather`, ``e`` integer-valued)
and ``Sum(body, (m, lo, hi))`` over literal bounds, expanded term by term (docs/priors.md,
"Vectors, sums and named sub-formulas"). Sizes are bounded so that no formula can make SymPy work for long: text length,
nesting depth, literal magnitude, constant powers, the degree that nested powers multiply to, and
every constant must fit in a float. :func:`evaluate` computes a formula in float64, as a kernel
would, and refuses what SymPy's exact arithmetic could only do with astronomically large numbers.
"""
from __future__ import annotations

import ast
import io
import keyword
import math
import re
import tokenize
import warnings
from dataclasses import dataclass
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
    "erf": sp.erf, "sin": sp.sin, "cos": sp.cos, "Sum": None,   # Sum: expanded, see _sum
}
CONSTANTS: Mapping[str, sp.Expr] = {"pi": sp.pi, "E": sp.E, "oo": sp.oo}
# Functions the language leaves out, as a formula writes them with the functions it has, for
# the hint of an unknown function: (the call's arguments as the rewrite names them, the
# rewrite). {x} is an argument as written, {(x)} the same in parentheses unless it is a name,
# a number or a call. softplus written so is computed as a log-sum-exp (docs/priors.md).
REWRITES: Mapping[str, tuple[tuple[str, ...], str]] = {
    "log1p": (("x",), "log(1 + {x})"),
    "expm1": (("x",), "exp({x}) - 1"),
    "log2": (("x",), "log({x})/log(2)"),
    "log10": (("x",), "log({x})/log(10)"),
    "ln": (("x",), "log({x})"),
    "exp2": (("x",), "2**{(x)}"),
    # (1/(1 + exp(-x)) overflows far out, where its derivative is nan; inside a log, write
    # -log(1 + exp(-x)): a log-sum-exp)
    "sigmoid": (("x",), "(1 + tanh({(x)}/2))/2"),
    "softplus": (("x",), "log(1 + exp({x}))"),
    "relu": (("x",), "Max({x}, 0)"),
    "abs": (("x",), "Abs({x})"),
    "fabs": (("x",), "Abs({x})"),
    "max": (("x", "y"), "Max({x}, {y})"),
    "min": (("x", "y"), "Min({x}, {y})"),
    "clip": (("x", "lo", "hi"), "Min(Max({x}, {lo}), {hi})"),
    "clamp": (("x", "lo", "hi"), "Min(Max({x}, {lo}), {hi})"),
    "ceil": (("x",), "ceiling({x})"),
    "sgn": (("x",), "sign({x})"),
    "arctan": (("x",), "atan({x})"),
    "erfc": (("x",), "1 - erf({x})"),
    "rsqrt": (("x",), "1/sqrt({x})"),
    "tan": (("x",), "sin({x})/cos({x})"),
    "square": (("x",), "{(x)}**2"),
    "pow": (("x", "y"), "{(x)}**{(y)}"),
}
MAX_REWRITE_ARGUMENT = 40   # characters of an argument a hint repeats; beyond, it says x
# True and False are the conditions of a Piecewise's last pair, None a constant (as in Python),
# and/or join conditions: names of the language, which no parameter or let may take
RESERVED = frozenset(FUNCTIONS) | frozenset(CONSTANTS) | {"True", "False", "None", "and", "or"}
# The Python keywords a formula reads as names (a decay rate lambda, a parameter in): every other
# keyword (docs/priors.md, "Names")
KEYWORD_NAMES = frozenset(keyword.kwlist) - RESERVED
# Parameter and let names: Python identifiers (σ, λ too: Python 3 takes Unicode letters, and so
# do the formulas, parsed by Python's ast), in the form Python reads them (NFKC), at most 64
# characters.
MAX_NAME = 64
MAX_SUM_TERMS = 256    # terms of a Sum once expanded (nested Sums: the product of their lengths)
MAX_SUM_EXPANSION = 2_000_000   # nodes of all the expanded copies of Sum bodies, in one formula


class ElementSymbol(sp.Symbol):
    """Element k of a vector parameter, named ``w[k]``: the brackets keep it apart from every
    parameter's Symbol (an identifier), and it prints as the user wrote it."""

    def __new__(cls, vector: str, index: int, **assumptions):
        obj = super().__new__(cls, f"{vector}[{index}]", **assumptions)
        return obj

    def __getnewargs_ex__(self):
        vector, _, rest = self.name.partition("[")
        return (vector, int(rest[:-1])), self.assumptions0

    @property
    def vector(self) -> str:
        return self.name.partition("[")[0]

    @property
    def index(self) -> int:
        return int(self.name.partition("[")[2][:-1])

    @classmethod
    def class_key(cls):
        return sp.Symbol.class_key()


class Gather(sp.Function):
    """``w[e]``: the element clamp(floor(e), 0, K - 1) of a vector w of K elements
    (arguments: e, w[0], ..., w[K - 1]); e is integer-valued where positions are tokens, and
    may be fractional at float positions. A constant e picks its element directly; the
    derivative in w[k] is 1 where clamp(floor(e)) = k, else 0 (the index is piecewise
    constant: its own derivative is 0)."""

    @classmethod
    def eval(cls, index, *elements):
        if index.is_Number and elements:
            return elements[clamp_index(float(index), len(elements))]
        return None

    def _eval_is_real(self):
        return True

    def _eval_is_positive(self):
        return all(e.is_positive for e in self.args[1:]) or None

    def _eval_is_nonnegative(self):
        return all(e.is_nonnegative for e in self.args[1:]) or None

    def fdiff(self, argindex=1):
        if argindex == 1:
            return sp.S.Zero
        return selects(self.args[0], argindex - 2, len(self.args) - 1)


class ElementFloor(sp.floor):
    """The floor of a vector's index, the element ``w[e]`` reads, taken once per index where it
    is named (lower._name_indices): printed as the target's plain floor, the index's own floors
    having snapped their near-integers already (printers: ``floor`` under exact printing)."""


def clamp_index(value: float, size: int) -> int:
    """An integer-valued index clamped into [0, size - 1] (NaN reads the first element, as
    the runtime's element_at does)."""
    if value != value:
        return 0
    if math.isinf(value):   # (log(0) and 1/0 clamp to an end like any index out of range)
        return 0 if value < 0 else size - 1
    return int(min(max(math.floor(value), 0), size - 1))


def selects(index: sp.Expr, k: int, size: int) -> sp.Expr:
    """1 where the clamped floor of ``index`` is k, else 0: d w[index] / d w[k]."""
    if size == 1:
        return sp.S.One
    return Selects(index, sp.Integer(k), sp.Integer(size))


class Selects(sp.Function):
    """1 where clamp(floor(index), 0, size - 1) = k, else 0 (arguments: index, k, size): the derivative
    of a Gather in one element. A function of its own, so that SymPy keeps the comparison
    as written (a Piecewise index inside a relational becomes an ITE it cannot print)."""

    @classmethod
    def eval(cls, index, k, size):
        if index.is_Number:
            return sp.S.One if clamp_index(float(index), int(size)) == int(k) else sp.S.Zero
        return None

    def _eval_is_real(self):
        return True

    def _eval_is_nonnegative(self):
        return True

    def fdiff(self, argindex=1):
        return sp.S.Zero


def is_integer_valued(expr: sp.Basic) -> bool:
    """True when ``expr`` takes integer values wherever it is defined, by its form: integers,
    positions (d, i, j, n) and Sum indices, floor and ceiling, and sums, products, non-negative
    integer powers, Abs, sign, Min, Max and Piecewise values of integer-valued parts."""
    if isinstance(expr, sp.Integer) or (expr.is_Number and float(expr).is_integer()):
        return True
    if isinstance(expr, sp.Symbol):
        return bool(expr.is_integer) or expr.name in POSITION_NAMES
    if isinstance(expr, (sp.floor, sp.ceiling, sp.sign)):
        return True
    if isinstance(expr, sp.Pow):
        return (expr.exp.is_Integer and expr.exp >= 0) and is_integer_valued(expr.base)
    if isinstance(expr, sp.Piecewise):
        return all(is_integer_valued(piece.expr) for piece in expr.args)
    if isinstance(expr, (sp.Add, sp.Mul, sp.Min, sp.Max, sp.Abs)):
        return all(is_integer_valued(a) for a in expr.args)
    return False


POSITION_NAMES_IN_ORDER = ("d", "i", "j", "n")
POSITION_NAMES = frozenset(POSITION_NAMES_IN_ORDER)
# a position of one channel of a prior over several (spec.position_names: d0, i1, j2, ..), whose
# formulas have these in place of d, i and j (and no parameter or let may take such a name)
CHANNEL_POSITION = re.compile(r"[dij][0-9]+")

_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}
# SymPy's relations written as calls, inside a Piecewise condition: Eq(d, 0) is d == 0
RELATIONS = {"Eq": ast.Eq, "Ne": ast.NotEq, "Lt": ast.Lt, "Le": ast.LtE, "Gt": ast.Gt,
             "Ge": ast.GtE}
_COMPARE = {ast.Lt: sp.Lt, ast.LtE: sp.Le, ast.Gt: sp.Gt, ast.GtE: sp.Ge,
            ast.Eq: sp.Eq, ast.NotEq: sp.Ne}


def _literal_problem(value: float) -> str:
    """Why a float literal is refused: one beyond the float limit (1e400) reads as infinity,
    which the message says rather than showing only 'inf'."""
    if math.isinf(value):
        return (f"the number is beyond the largest float (about 1.8e308), so YAML or Python "
                f"reads it as {value!r}; numbers up to {MAX_LITERAL:g} in magnitude are allowed")
    if math.isnan(value):
        return "the number is nan (not a number)"
    return f"the number {value!r} is larger than {MAX_LITERAL:g}"


def parse_formula(text: object, symbols: Mapping[str, sp.Expr], *, field: str,
                  line: int | None = None,
                  vectors: Mapping[str, tuple[sp.Symbol, ...]] | None = None,
                  kinks: dict | None = None, symbols_hint: str | None = None,
                  unavailable: Mapping[str, tuple[str, str]] | None = None) -> sp.Expr:
    """Parse ``text`` into a SymPy expression over ``symbols`` (a name stands for its symbol,
    or for a named sub-formula's expression) and the elements of ``vectors`` (``w[e]``); raise
    SpecError on anything else. kinks: filled with {the argument u of an Abs(u) in an expanded
    Sum term: the argument as the Sum's body writes it}, so that the language's limit on kinks
    counts a body once, not once per term. symbols_hint: the hint for an unknown symbol where
    the field reads other names than a prior's formulas (an init reads h and H only).
    unavailable: {name: (message, hint)} of names the file declares but this formula may not
    read (a let entry below the one being read, or itself), which are no unknown symbols."""
    def fail(msg: str, hint: str | None = None) -> SpecError:
        return SpecError(msg, field=field, line=line, hint=hint)

    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise fail(f"expected a formula (a string or a number), got {type(text).__name__}",
                   "write the formula as a quoted string")
    if isinstance(text, (int, float)):
        if isinstance(text, int) and abs(text) > MAX_LITERAL:   # before repr: 10**5000 has none
            raise fail(f"the number ({text.bit_length()} bits) is larger than {MAX_LITERAL:g}")
        if isinstance(text, float) and not (math.isfinite(text) and abs(text) <= MAX_LITERAL):
            raise fail(_literal_problem(text))
        text = repr(text)
    if not text.strip():
        raise fail("the formula is empty", "write an expression such as '-Abs(d)/b'")
    if len(text) > MAX_FORMULA_CHARS:
        raise fail(f"the formula is {len(text)} characters long; the limit is {MAX_FORMULA_CHARS}")
    if "\x00" in text:
        raise fail("the formula contains a NUL byte")
    if any("\ud800" <= c <= "\udfff" for c in text):
        raise fail("the formula contains a lone surrogate character (U+D800 to U+DFFF), which "
                   "is not text", "save the prior file as UTF-8 and write the formula in plain text")
    if "#" in text or "\\" in text:
        # The text is copied into the generated module's docstrings: no comments, no escapes.
        raise fail("comments ('#') and backslashes are not allowed in a formula",
                   "put remarks in 'description'")
    source = _Source.parse(text.strip(), {*symbols, *(vectors or {})}, fail)
    builder = _Builder(symbols, fail, vectors or {}, {} if kinks is None else kinks, symbols_hint,
                       source=source, unavailable=unavailable)
    try:
        expr = builder.build(source.tree.body, depth=0)
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


@dataclass(frozen=True)
class _Source:
    """A formula's text and its tree as Python's parser reads them. A keyword that names
    something (lambda, in) is renamed token by token, for the parser alone, to a name no prior
    can declare (longer than MAX_NAME characters, and not in the text); the tree's names are
    then the user's again, so that the symbols and every message see the name as written."""
    text: str                      # what was parsed: the text with the keywords renamed
    tree: ast.Expression
    written: Mapping[str, str]     # {the parser's name: the keyword the user wrote}

    @classmethod
    def parse(cls, text: str, declared, fail) -> "_Source":
        """The declared names that are keywords renamed; failing that, every keyword the text
        may use as a name (an undeclared lambda is then an unknown symbol, not a syntax
        error). The language's own keywords and/or stay operators."""
        try:
            return cls._parse(text, {*declared} & KEYWORD_NAMES)
        except SyntaxError as exc:
            first = exc
        except (RecursionError, MemoryError):
            raise fail("the formula is nested too deeply to parse", "simplify the expression") from None
        try:
            return cls._parse(text, KEYWORD_NAMES)
        except (SyntaxError, RecursionError, MemoryError):
            raise fail(f"cannot parse {text!r}: {first.msg}",
                       "use Python/SymPy syntax, e.g. -(Abs(d - mu)/alpha)**beta") from None

    @classmethod
    def _parse(cls, text: str, names) -> "_Source":
        renamed, written = _rename_keywords(text, names)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # SyntaxWarnings would print a second line
            tree = ast.parse(renamed, mode="eval")
        if written:
            for node in ast.walk(tree):
                if isinstance(node, ast.Name) and node.id in written:
                    node.id = written[node.id]
        return cls(renamed, tree, written)

    def segment(self, node: ast.AST) -> str:
        """The text of ``node`` as the user wrote it."""
        text = ast.get_source_segment(self.text, node) or ast.unparse(node)
        for internal, name in self.written.items():
            text = text.replace(internal, name)
        return text


def _rename_keywords(text: str, names) -> tuple[str, dict[str, str]]:
    """``text`` with each keyword of ``names`` that it spells as a token renamed to a name of
    more than MAX_NAME characters that the text does not hold (so nothing else is that name),
    and {the new name: the keyword}. Tokens after one that does not tokenize stay as written
    (the parser then says what is wrong there)."""
    starts = [0] + [k + 1 for k, c in enumerate(text) if c == "\n"]
    found = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.NAME and tok.string in names:
                (row, col), (_, end) = tok.start, tok.end
                found.append((starts[row - 1] + col, starts[row - 1] + end, tok.string))
    except (tokenize.TokenError, SyntaxError):
        pass
    internal = {}
    for name in sorted({name for _, _, name in found}):
        internal[name] = f"keyword_{name}".ljust(MAX_NAME + 1, "_")
        while internal[name] in text:
            internal[name] += "_"
    for start, end, name in reversed(found):
        text = text[:start] + internal[name] + text[end:]
    return text, {new: name for name, new in internal.items()}


class _Builder:
    """Rebuilds a whitelisted Python AST as a SymPy expression."""

    def __init__(self, symbols: Mapping[str, sp.Expr], fail,
                 vectors: Mapping[str, tuple[sp.Symbol, ...]], kinks: dict,
                 symbols_hint: str | None = None, source: _Source | None = None,
                 unavailable: Mapping[str, tuple[str, str]] | None = None):
        self.symbols = dict(symbols)
        self.unavailable = unavailable or {}
        self.symbols_hint = symbols_hint
        self.source = source     # the formula's text and tree, quoted back in hints as written
        self.fail = fail
        self.vectors = vectors
        self.kinks = kinks
        self.sum_terms = 1       # the product of the lengths of the Sums being built
        self.expanded = 0        # nodes built by expanding Sum bodies so far

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
                raise self.fail(_literal_problem(value))
            return sp.Float(repr(value))
        raise self.fail(f"the constant {value!r} is not a number")

    def _Name(self, node: ast.Name, depth: int):
        name = node.id
        if name in self.symbols:
            return self.symbols[name]
        if name in self.vectors:
            raise self.fail(f"'{name}' is a vector of {len(self.vectors[name])} elements: use one "
                            f"element, {name}[k]", f"e.g. {name}[0], or {name}[bucket] with an "
                            f"integer-valued index")
        if name.startswith("_"):
            raise self.fail(f"unknown symbol '{name}' (and a name starting with '_' is never a "
                            f"function or constant of the language)")
        if name in CONSTANTS:
            return CONSTANTS[name]
        if name in ("True", "False"):
            return sp.true if name == "True" else sp.false
        if name in FUNCTIONS:
            raise self.fail(f"the function '{name}' must be called, e.g. {name}(d)")
        if name in self.unavailable:
            raise self.fail(*self.unavailable[name])
        known = ", ".join(sorted([*self.symbols, *(f"{v}[k]" for v in self.vectors)])) or "none"
        raise self.fail(f"unknown symbol '{name}'", self.symbols_hint or
                        f"symbols allowed here: {known}; declare parameters under 'params'")

    def _UnaryOp(self, node: ast.UnaryOp, depth: int):
        operand = self.build(node.operand, depth)
        if isinstance(node.op, ast.USub):
            return -operand
        if isinstance(node.op, ast.UAdd):
            return operand
        raise self.fail(f"the operator {type(node.op).__name__} is not allowed")

    def _BinOp(self, node: ast.BinOp, depth: int):
        chain = (ast.Add, ast.Sub) if isinstance(node.op, (ast.Add, ast.Sub)) else \
            (ast.Mult, ast.Div) if isinstance(node.op, (ast.Mult, ast.Div)) else None
        if chain is not None:
            return self._chain(node, chain, depth)
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

    def _chain(self, node: ast.BinOp, ops: tuple, depth: int):
        """a + b - c + ... (or a * b / c ...) as one level of nesting, built left to right
        without recursion: Python parses it as a left-nested tree, and a sum of 40 terms is
        not a formula nested 40 deep."""
        rights = []
        while isinstance(node, ast.BinOp) and isinstance(node.op, ops):
            rights.append((node.op, node.right))
            node = node.left
        value = self.build(node, depth)
        self._require_expr(value)
        for op, right in reversed(rights):
            operand = self.build(right, depth)
            self._require_expr(operand)
            value = _BINOPS[type(op)](value, operand)
            if isinstance(value, sp.Expr) and value.is_number:
                self._check_constant(value)
        return value

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

    def _Subscript(self, node: ast.Subscript, depth: int):
        """``w[e]``: an element of a vector parameter, ``e`` integer-valued (clamped)."""
        if not isinstance(node.value, ast.Name) or node.value.id not in self.vectors:
            what = node.value.id if isinstance(node.value, ast.Name) else _describe(node.value)
            raise self.fail(f"indexing is allowed on vector parameters only, not on '{what}'",
                            "declare a vector with size: params: {w: {size: 32, init: 0.0}}")
        name = node.value.id
        if isinstance(node.slice, (ast.Slice, ast.Tuple)):
            raise self.fail(f"{name}[...] takes one index, not a slice or several",
                            f"e.g. {name}[0] or {name}[floor(d / 8)]")
        index = self.build(node.slice, depth)
        self._require_expr(index)
        if not is_integer_valued(index):
            raise self.fail(f"the index of {name}[{_short(index)}] is not integer-valued",
                            self._index_hint(name, node.slice))
        size = len(self.vectors[name])
        if index.is_Number and not 0 <= index <= size - 1:
            # (a computed index is clamped; a constant one outside is a slip for every use)
            raise self.fail(f"the index of {name}[{_short(index)}] is outside its {size} "
                            f"elements", f"write an index from 0 to {size - 1} (there are no "
                            f"negative indices: {name}[{size - 1}] is the last element)")
        return Gather(index, *self.vectors[name])

    def _index_hint(self, name: str, index: ast.AST) -> str:
        """What an index may be, in this formula's own positions (d, i, j, n over one channel;
        over several, d0, i0, .. are real numbers and n alone an integer), and the refused index
        under floor() as the formula spells it, which builds (its element at the floor)."""
        integers = [p for p in POSITION_NAMES_IN_ORDER if p in self.symbols]
        reals = [] if "d" in self.symbols else sorted(   # (one channel's d0 is a parameter)
            (p for p in self.symbols if CHANNEL_POSITION.fullmatch(p)), key=lambda p: (p[0], int(p[1:])))
        text = self.source.segment(index)
        example = f"{name}[floor({text})]" if len(text) <= MAX_REWRITE_ARGUMENT else \
            f"{name}[floor(...)]"
        hint = (f"an index is an integer, {''.join(p + ', ' for p in integers)}a Sum's index, "
                f"floor(...) or ceiling(...), or Min, Max, Piecewise, +, - and * of those")
        if reals:
            hint += f"; this prior's positions {', '.join(reals)} are real numbers"
        return f"{hint}: e.g. {example}"

    def _sum(self, node: ast.Call, depth: int):
        """``Sum(body, (m, lo, hi))``, lo and hi integer literals, inclusive: the body built once
        with m as an integer symbol, then one copy per value of m (an element w[m] becomes
        w[lo], w[lo + 1], ...)."""
        if len(node.args) != 2 or not isinstance(node.args[1], ast.Tuple) \
                or len(node.args[1].elts) != 3 or not isinstance(node.args[1].elts[0], ast.Name):
            raise self.fail("Sum takes a body and (index, first, last)",
                            "e.g. Sum(w[m] * cos(d * m), (m, 0, 31)): bounds inclusive")
        index_node, lo_node, hi_node = node.args[1].elts
        name = index_node.id
        if name in self.symbols or name in self.vectors or name in FUNCTIONS \
                or name in CONSTANTS or name.startswith("_"):
            raise self.fail(f"the Sum's index '{name}' already names something else in the formula",
                            "choose a new name for the index, e.g. m")
        lo, hi = self._literal_int(lo_node, "first"), self._literal_int(hi_node, "last")
        if hi < lo:
            raise self.fail(f"the Sum runs from {lo} to {hi}: the last index is below the first",
                            "bounds are inclusive: Sum(body, (m, 0, 31)) has 32 terms")
        terms = hi - lo + 1
        if self.sum_terms * terms > MAX_SUM_TERMS:
            raise self.fail(f"the Sum has {self.sum_terms * terms} terms (nested Sums multiply); "
                            f"the limit is {MAX_SUM_TERMS}", "sum over fewer elements")
        index = sp.Symbol(name, integer=True)
        self.symbols[name] = index
        self.sum_terms *= terms
        try:
            body = self.build(node.args[0], depth)
        finally:
            del self.symbols[name]
            self.sum_terms //= terms
        self._require_expr(body)
        self.expanded += terms * tree_size(body, {})
        if self.expanded > MAX_SUM_EXPANSION:
            raise self.fail(f"the Sums expand to more than {MAX_SUM_EXPANSION} terms in all",
                            "make the bodies shorter or sum over fewer elements")
        written = [a.args[0] for a in body.atoms(sp.Abs)
                   if any(sym.name in POSITION_NAMES for sym in a.args[0].free_symbols)]
        reads = [g for g in body.atoms(Gather) if g.args[0].has(index)]
        terms = []
        for k in range(lo, hi + 1):
            at = {index: sp.Integer(k)}
            for g in reads:   # (w[m] past w's end is a slip for every use, as w[40] is)
                at_k = g.args[0].xreplace(at)
                if at_k.is_Number and not 0 <= at_k <= len(g.args) - 2:
                    raise self.fail(f"the Sum reads element {at_k} of a vector of {len(g.args) - 1} "
                                    f"at {name} = {k}", f"keep the index of every element the "
                                    f"Sum reads within 0 to {len(g.args) - 2}")
            terms.append(body.xreplace(at))
            for u in written:
                self.kinks[u.xreplace(at)] = self.kinks.get(u, u)
        return sp.Add(*terms)

    def _literal_int(self, node: ast.AST, which: str) -> int:
        negative = isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
        inner = node.operand if negative else node
        if not (isinstance(inner, ast.Constant) and isinstance(inner.value, int)
                and not isinstance(inner.value, bool)) or abs(inner.value) > MAX_LITERAL:
            raise self.fail(f"the Sum's {which} index must be an integer literal",
                            "e.g. Sum(w[m], (m, 0, 31))")
        return -inner.value if negative else inner.value

    def _Call(self, node: ast.Call, depth: int):
        if not isinstance(node.func, ast.Name):
            raise self.fail(f"{_describe(node.func)} cannot be called",
                            "call a whitelisted function by name, e.g. exp(-d)")
        name = node.func.id
        if name in RELATIONS and name not in self.symbols:
            # SymPy's spelling of a comparison, as `bamgen show` prints one: Eq(d, 0) is d == 0
            if node.keywords:
                raise self.fail(f"keyword arguments are not allowed in {name}(...)")
            if len(node.args) != 2:
                raise self.fail(f"{name} takes 2 arguments, got {len(node.args)}",
                                f"e.g. Piecewise((0, {name}(d, 0)), (-Abs(d), True))")
            compare = ast.Compare(left=node.args[0], ops=[RELATIONS[name]()],
                                  comparators=[node.args[1]])
            return self._Compare(ast.copy_location(compare, node), depth)
        if name not in FUNCTIONS:
            allowed = "allowed functions: " + ", ".join(sorted(FUNCTIONS))
            rewrite = _rewrite(node, name, self.source.segment)
            raise self.fail(f"unknown function '{name}'",
                            f"write {rewrite}; {allowed}" if rewrite else allowed)
        if node.keywords:
            raise self.fail(f"keyword arguments are not allowed in {name}(...)")
        if name == "Piecewise":
            return self._piecewise(node, depth)
        if name == "Sum":
            return self._sum(node, depth)
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
        if name == "log" and args[0].is_zero:
            # log(0) is the zero of a prior, -oo, as a window's (-oo, True) writes it; SymPy
            # makes it zoo, the complex infinity, which no formula may hold
            return sp.S.NegativeInfinity
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


def _rewrite(call: ast.Call, name: str, segment) -> str | None:
    """'f(args) as <the same with the language's functions>' for a function of REWRITES, with
    the call's own arguments (as ``segment`` gives their text) where they are short, or None: a user
    who wrote log1p(r*d) reads the formula to write in its place."""
    if name not in REWRITES:
        return None
    params, template = REWRITES[name]
    texts = [segment(a) for a in call.args]
    if (name in ("max", "min") and 2 < len(texts) <= MAX_MINMAX_ARGS and not call.keywords
            and all(len(t) <= MAX_REWRITE_ARGUMENT for t in texts)):   # Max takes them all
        return f"{name}({', '.join(texts)}) as {name.capitalize()}({', '.join(texts)})"
    if (len(texts) != len(params) or call.keywords
            or any(len(t) > MAX_REWRITE_ARGUMENT for t in texts)):
        texts, nodes = list(params), [ast.Name(p) for p in params]
    else:
        nodes = call.args
    values = {}
    for p, text, node in zip(params, texts, nodes):
        values[p] = text
        values[f"({p})"] = text if isinstance(node, (ast.Name, ast.Constant, ast.Call)) else f"({text})"
    return f"{name}({', '.join(texts)}) as {template.format_map(values)}"


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
    sp.erf: math.erf, sp.atan: math.atan, sp.sin: math.sin, sp.cos: math.cos,
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
        if isinstance(e, Selects):
            index, big = self.value(e.args[0])
            return float(clamp_index(index, int(e.args[2])) == int(e.args[1])), False
        if isinstance(e, Gather):   # the element the clamped index picks, alone
            index, big = self.value(e.args[0])
            if big:
                raise OverflowError("an index that overflows a float")
            return self.value(e.args[1 + clamp_index(index, len(e.args) - 1)])
        args = [self.value(a) for a in e.args] if not isinstance(e, sp.Piecewise) else []
        xs = [x for x, _ in args]
        if e.is_Add:
            return self._out(sum(xs), args)
        if e.is_Mul:
            return self._product(e, args)
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
            except ValueError:      # floor or ceiling of nan, sin or cos of inf
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

    def _product(self, e: sp.Mul, args) -> tuple[float, bool]:
        """A product as the printed code computes it: the factors of a negative rational power
        divide (SymPy prints a*b**-1 as a/b), rather than multiply by their reciprocal, which
        rounds apart: log(H)/log(2) is 3.0 at H = 8 divided, 2.9999999999999996 times
        1/log(2), and floor() tells them apart (ALiBi's init in priors/laplace.yaml)."""
        numerator, denominator = [], []
        for factor, (x, big) in zip(e.args, args):
            if factor.is_Pow and factor.exp.is_Rational and factor.exp.is_negative:
                flipped = factor.base if factor.exp == -1 else sp.Pow(factor.base, -factor.exp)
                denominator.append(self.value(flipped)[0])
            else:
                numerator.append(x)
        if not denominator:
            return self._out(math.prod(numerator), args)
        top, bottom = math.prod(numerator), math.prod(denominator)
        try:
            y = top / bottom
        except ZeroDivisionError:   # as 1/0 in float64: inf (nan for 0/0)
            y = math.nan if top == 0 or math.isnan(top) else math.copysign(math.inf, top)
        return self._out(y, args)

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
