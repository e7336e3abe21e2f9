"""SymPy to Triton and SymPy to torch printers.

In the manner of ``sympy/printing/pycode.py``: a printer is a mapping table from SymPy function
names to target calls plus a few ``_print_X`` methods for the nodes that need care (powers,
conditions, Piecewise). A rewrite pass runs before printing (:func:`prepare`): numeric
sub-expressions become floats, and for Triton the hyperbolic functions become exponentials.

Powers are where speed is won or lost: an integer exponent becomes products (``x**2`` is
``x*x``, never ``exp2(2*log2(x))``), 1/2 becomes ``sqrt``, and only a non-integer or symbolic
exponent pays for ``exp2(e * log2(x))`` (two special-function calls).
"""
from __future__ import annotations

import struct
from typing import Mapping

import sympy as sp
from sympy.printing.precedence import PRECEDENCE
from sympy.printing.str import StrPrinter

from .formula import MAX_TREE, tree_size

MAX_UNROLLED_POWER = 8


def prepare(expr: sp.Expr, *, target: str) -> sp.Expr:
    """Rewrite an expression for printing: fold numeric constants, expand what has no intrinsic.

    Both passes visit each distinct sub-expression once: an expression is a DAG (the derivative
    of tanh(tanh(tanh(u))) refers to each inner tanh many times), and a walk of the tree it
    stands for can be exponentially longer."""
    if target == "triton":   # (float64 Triton has helpers for them: _sinh64, _cosh64, _tanh64)
        expr = _bottom_up(expr, _hyperbolic_to_exp)
    return _bottom_up(expr, _fold_number)


def _hyperbolic_to_exp(e: sp.Expr) -> sp.Expr:
    """sinh, cosh and tanh in exponentials (Triton has no intrinsic for them). tanh(u) becomes
    1 - 2/(exp(2u) + 1), which is -1 or 1 where exp overflows; the textbook
    (exp(u) - exp(-u))/(exp(u) + exp(-u)) would be inf/inf = nan for |u| > 88."""
    if isinstance(e, sp.tanh):
        return 1 - 2 / (sp.exp(2 * e.args[0]) + 1)
    if isinstance(e, (sp.sinh, sp.cosh)):
        return e.rewrite(sp.exp)
    return e


def _fold_number(e: sp.Expr) -> sp.Expr:
    if isinstance(e, sp.Expr) and e.is_number and not e.is_Atom and not isinstance(e, sp.Rational):
        return sp.Float(e.evalf(17), 17)
    return e


def _bottom_up(expr: sp.Basic, rule) -> sp.Basic:
    """``rule`` applied to every node after its arguments, as ``Basic.replace`` does, with each
    distinct node rewritten once. A rewrite may copy its argument (sinh(u) is
    exp(u)/2 - exp(-u)/2): no node is built whose tree would exceed MAX_TREE, since SymPy's
    constructors walk the trees they are given."""
    memo: dict = {}
    sizes: dict = {}

    def walk(e):
        done = memo.get(e)
        if done is not None:
            return done
        if e.args:
            args = tuple(walk(a) for a in e.args)
            if 1 + sum(tree_size(a, sizes) for a in args) > MAX_TREE:
                raise ExpressionTooLarge(f"more than {MAX_TREE} terms")
            out = rule(e.func(*args) if args != e.args else e)
        else:
            out = rule(e)
        if tree_size(out, sizes) > MAX_TREE:
            raise ExpressionTooLarge(f"more than {MAX_TREE} terms")
        memo[e] = out
        return out

    return walk(expr)


class ExpressionTooLarge(ValueError):
    """A rewrite for printing would build a tree larger than MAX_TREE nodes."""


class NotARealNumber(ValueError):
    """A constant that no kernel can compute (I, zoo, nan): the formula leaves the reals."""


class _KernelPrinter(StrPrinter):
    """Shared printing rules; subclasses give the function table and a few intrinsics."""
    functions: Mapping[str, str] = {}
    where = ""
    minimum = ""
    maximum = ""
    float64 = "{}"
    element = ""
    snapped: Mapping[str, str] = {}

    def __init__(self, names: Mapping[sp.Symbol, str], exact: bool = False):
        super().__init__({"full_prec": False})
        # keyed by the symbol itself, assumptions included: a parameter named c0 and a
        # temporary named c0 are different symbols and must never print as each other
        self.names = dict(names)
        # exact: every variable read in float64 (an index of a vector, whose bucket boundaries
        # must land where float64 puts them on every path: docs/priors.md, "Vectors")
        self.exact = exact

    # leaves ---------------------------------------------------------------------------
    def _print_Symbol(self, expr):
        try:
            name = self.names[expr]
        except KeyError:
            raise KeyError(f"no kernel variable for symbol {expr.name}") from None
        return self.float64.format(name) if self.exact else name

    _print_Dummy = _print_Symbol

    def _not_real(self, expr):
        raise NotARealNumber(f"the constant {expr} is not a real number")

    _print_ImaginaryUnit = _not_real
    _print_ComplexInfinity = _not_real
    _print_NaN = _not_real

    def _print_Float(self, expr):
        value = float(expr)
        if value != value or value in (float("inf"), float("-inf")):
            return f'float("{value}")'
        return repr(value)

    def _print_Integer(self, expr):
        return repr(float(expr))

    def _print_Rational(self, expr):
        return repr(float(expr))

    def _print_Half(self, expr):
        return "0.5"

    def _print_Infinity(self, expr):
        return 'float("inf")'

    def _print_NegativeInfinity(self, expr):
        return '-float("inf")'

    def _print_Pi(self, expr):
        return repr(float(sp.pi))

    def _print_Exp1(self, expr):
        return repr(float(sp.E))

    # arithmetic -----------------------------------------------------------------------
    def _print_Pow(self, expr, rational=False):
        base, exp = expr.base, expr.exp
        b = self.parenthesize(base, PRECEDENCE["Atom"] - 1 if base.is_Atom else PRECEDENCE["Pow"])
        if exp.is_Number and float(exp).is_integer() and abs(float(exp)) <= MAX_UNROLLED_POWER:
            n = int(float(exp))
            if n == 0:
                return "1.0"
            product = "*".join([b] * abs(n))
            if n > 0:
                return product if n == 1 else f"({product})"
            return f"(1.0/({product}))"
        if exp == sp.S.Half or (exp.is_Number and float(exp) == 0.5):
            return self.sqrt(self._print(base))
        if exp == -sp.S.Half or (exp.is_Number and float(exp) == -0.5):
            return self.rsqrt(self._print(base))
        return self.power(self._print(base), self._print(exp))

    # functions ------------------------------------------------------------------------
    def _print_Function(self, expr):
        name = type(expr).__name__
        if self.exact and name in ("floor", "ceiling"):
            # an index's floor or ceiling snaps a value within a few ulps of an integer to it:
            # float64 gives log(8)/log(16) * 8 as 5.999999999999999 in one order of the
            # operations and 6 in another, and the exact value, 6, is where T5 puts its bucket
            return self.snapped[name].format(self._print(expr.args[0]))
        fmt = self.functions.get(name)
        if fmt is None:
            raise NotImplementedError(f"{name} has no {type(self).__name__} translation")
        return fmt.format(*[self._print(a) for a in expr.args])

    def _print_ElementFloor(self, expr):
        """The element an index reads (formula.ElementFloor): the target's plain floor."""
        return self.functions["floor"].format(self._print(expr.args[0]))

    _print_exp = _print_Function
    _print_log = _print_Function
    _print_Abs = _print_Function
    _print_sign = _print_Function
    _print_floor = _print_Function
    _print_ceiling = _print_Function
    _print_erf = _print_Function
    _print_atan = _print_Function
    _print_sinh = _print_Function
    _print_cosh = _print_Function
    _print_tanh = _print_Function
    _print_sin = _print_Function
    _print_cos = _print_Function

    def _print_Gather(self, expr):
        """w[e]: the runtime's element selection (bamgen.runtime's element_at on the CPU,
        its Triton twin _element in the kernels): a chain of selects on the float64 index,
        w[0] below 1, w[K - 1] from K - 1 on (the clamp), as formula.clamp_index."""
        printed = [self._print(e) for e in expr.args[1:]]
        vector = printed[0].rpartition("[")[0]
        if printed[0].endswith("[0]") and printed == [f"{vector}[{k}]" for k in range(len(printed))]:
            elements = vector   # the whole vector, as the hook holds it (a tuple)
        else:
            elements = "(" + ", ".join(printed) + ",)"
        return self.element.format(self._index(expr.args[0]), elements)

    def _print_Selects(self, expr):
        """1 where the clamped index's floor is k (the ends take what lies beyond them), else
        0: the element the gather reads, the largest k <= index (a fractional index, as a
        bucket of positions given as floats reads, picks its floor's element, and so does its
        gradient; NaN reads the first)."""
        index, k, size = expr.args
        at = self._index(index)
        k, size = int(k), int(size)
        if k == 0:
            return self.where.format(f"{at} >= 1.0", "0.0", "1.0")
        if k == size - 1:
            return self.where.format(f"{at} >= {float(k)!r}", "1.0", "0.0")
        if index.is_integer:   # (an index named by lower.py: already its floor)
            return self.where.format(f"{at} == {float(k)!r}", "1.0", "0.0")
        return self.where.format(f"{at} >= {float(k + 1)!r}", "0.0",
                                 self.where.format(f"{at} >= {float(k)!r}", "1.0", "0.0"))

    def _index(self, index) -> str:
        """An index, in float64: by name where lower.py computed it beforehand."""
        if isinstance(index, sp.Symbol) and index in self.names and not self.exact:
            return self.names[index]
        return type(self)(self.names, exact=True).doprint(index)

    def _print_Heaviside(self, expr):
        # Derivatives of Min/Max. The value at 0 is SymPy's default 1/2: ties split the
        # gradient evenly, as torch.maximum's backward does.
        x = self._print(expr.args[0])
        at_zero = self._print(expr.args[1]) if len(expr.args) > 1 else "0.5"
        return self.where.format(f"{x} > 0", "1.0", self.where.format(f"{x} < 0", "0.0", at_zero))

    def _print_Min(self, expr):
        return self._fold(self.minimum, expr.args)

    def _print_Max(self, expr):
        return self._fold(self.maximum, expr.args)

    def _fold(self, fn, args):
        out = self._print(args[-1])
        for a in reversed(args[:-1]):
            out = fn.format(self._print(a), out)
        return out

    # conditions -----------------------------------------------------------------------
    def _print_Piecewise(self, expr):
        out = self._branch(expr.args[-1].expr)
        for piece in reversed(expr.args[:-1]):
            out = self.where.format(self._print(piece.cond), self._branch(piece.expr), out)
        return out

    def _branch(self, expr):
        """A Piecewise branch's value as a select takes it."""
        return self._print(expr)

    def _print_Relational(self, expr):
        ops = {"==": "==", "!=": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}
        return f"({self._print(expr.lhs)} {ops[expr.rel_op]} {self._print(expr.rhs)})"

    def _print_And(self, expr):
        return "(" + " & ".join(self._print(a) for a in expr.args) + ")"

    def _print_Or(self, expr):
        return "(" + " | ".join(self._print(a) for a in expr.args) + ")"


class TritonPrinter(_KernelPrinter):
    """Prints fp32 Triton expressions over tiles and per-program scalars."""
    functions = {
        "exp": "tl.exp({})", "log": "tl.log({})", "Abs": "tl.abs({})",
        "floor": "tl.floor({})", "ceiling": "tl.ceil({})", "erf": "tl.erf({})",
        "sign": "tl.where({0} > 0, 1.0, tl.where({0} < 0, -1.0, 0.0))",
        "atan": "_atan({})",   # defined in the Triton template (no intrinsic)
        "sin": "tl.sin({})", "cos": "tl.cos({})",
    }
    where = "tl.where({}, {}, {})"
    float64 = "{}.to(tl.float64)"
    element = "_element({}, {})"   # bamgen/runtime/triton/helpers.py
    snapped = {"floor": "_index_floor({})", "ceiling": "_index_ceil({})"}
    minimum = "tl.minimum({}, {})"
    maximum = "tl.maximum({}, {})"

    def sqrt(self, x):
        return f"tl.sqrt({x})"

    def rsqrt(self, x):
        return f"tl.rsqrt({x})"

    def power(self, base, exp):
        return f"tl.exp2(({exp}) * tl.log2({base}))"


class TritonFloat64Printer(TritonPrinter):
    """Prints fp64 Triton expressions over float64 tiles and parameters: the distance-table
    kernel's hook (bamgen/runtime/triton/table.py), which evaluates the log-prior and its
    derivatives per (head, distance) in float64 as the host's torch code does.

    Triton types a literal by what it meets: with a float64 operand it is float64, exactly, but
    a select or a sum of two literals alone is float32. A literal that float32 cannot hold
    exactly (0.1) is printed as a float64 scalar so that no expression rounds it, and so is a
    number raised to a power (2**x: a literal argument of a helper is float32). Powers go
    through _pow64 (pow's special cases kept: x**0 = 1, a negative base to an integer power);
    sinh, cosh and tanh through helpers that take a series near 0, where the exponentials'
    difference cancels. A formula that reads atan (no float64 form here), sin or cos keeps the
    host's torch build: libdevice's float64 sin and cos each take a stack frame for their range
    reduction, and Sandwich's 64 cosines compiled for 21 s into a kernel with 13 kB of stack."""
    functions = {**TritonPrinter.functions, "atan": None, "sin": None, "cos": None,
                 "sinh": "_sinh64({})", "cosh": "_cosh64({})", "tanh": "_tanh64({})"}
    float64 = "{}"   # every value already is

    def _print_Float(self, expr):
        text = super()._print_Float(expr)
        value = float(expr)
        if value != value or value in (float("inf"), float("-inf")):
            return text
        return text if float(_as_float32(value)) == value else f"tl.full([], {text}, tl.float64)"

    def _print_Integer(self, expr):
        return self._print_Float(sp.Float(expr))

    def _print_Rational(self, expr):
        return self._print_Float(sp.Float(expr, 17))

    def _print_Pi(self, expr):
        return self._print_Float(sp.Float(sp.pi, 17))

    def _print_Exp1(self, expr):
        return self._print_Float(sp.Float(sp.E, 17))

    def _print_Function(self, expr):
        if self.functions.get(type(expr).__name__, "") is None:
            raise NotImplementedError(f"{type(expr).__name__} has no float64 Triton translation")
        return super()._print_Function(expr)

    _print_atan = _print_Function
    _print_sin = _print_Function
    _print_cos = _print_Function

    def _print_Pow(self, expr, rational=False):
        if expr.base.is_Number and not expr.exp.is_Number:
            return self.power(f"tl.full([], {float(expr.base)!r}, tl.float64)", self._print(expr.exp))
        return super()._print_Pow(expr, rational)

    def rsqrt(self, x):
        return f"(1.0/tl.sqrt({x}))"

    def power(self, base, exp):
        return f"_pow64({base}, {exp})"


def _as_float32(value: float) -> float:
    """value rounded to float32 (inf beyond its range)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return float("inf") if value > 0 else float("-inf")


class TorchPrinter(_KernelPrinter):
    """Prints torch expressions over float32 tensors (blocks and per-head parameter columns)."""
    functions = {
        "exp": "torch.exp({})", "log": "torch.log({})", "Abs": "torch.abs({})",
        "floor": "torch.floor({})", "ceiling": "torch.ceil({})", "erf": "torch.erf({})",
        "sign": "torch.sign({})", "atan": "torch.atan({})", "sinh": "torch.sinh({})",
        "cosh": "torch.cosh({})", "tanh": "torch.tanh({})", "sin": "torch.sin({})",
        "cos": "torch.cos({})",
    }
    where = "torch.where({}, {}, {})"
    float64 = "{}.double()"
    element = "element_at({}, {})"   # bamgen.runtime.params.element_at
    snapped = {"floor": "index_floor({})", "ceiling": "index_ceil({})"}
    minimum = "torch.minimum(torch.as_tensor({}), torch.as_tensor({}))"
    maximum = "torch.maximum(torch.as_tensor({}), torch.as_tensor({}))"

    def sqrt(self, x):
        return f"torch.sqrt(torch.as_tensor({x}))"

    def rsqrt(self, x):
        return f"torch.rsqrt(torch.as_tensor({x}))"

    def power(self, base, exp):
        return f"torch.pow({base}, {exp})"


class TorchFloat64Printer(TorchPrinter):
    """Prints the distance table's torch code, over float64 distances and parameters. A branch
    of a Piecewise that is a number float32 cannot hold (0.1) is printed as a float64 tensor:
    torch.where takes two Python floats as float32, and the table would round them twice."""

    def _branch(self, expr):
        text = self._print(expr)
        if expr.is_Number and expr.is_finite and float(_as_float32(float(expr))) != float(expr):
            return f"torch.tensor({text}, dtype=torch.float64)"
        return text


PRINTERS = {"triton": TritonPrinter, "triton64": TritonFloat64Printer, "torch": TorchPrinter,
            "torch64": TorchFloat64Printer}


def print_expr(expr: sp.Expr, names: Mapping[sp.Symbol, str], *, target: str,
               exact: bool = False) -> str:
    """Print one prepared expression for ``target`` ("triton", "triton64": float64 Triton,
    "torch", "torch64": the distance table's torch); exact: in float64."""
    return PRINTERS[target](names, exact=exact).doprint(expr)


__all__ = ["prepare", "print_expr", "ExpressionTooLarge", "NotARealNumber", "TritonPrinter",
           "TritonFloat64Printer", "TorchPrinter", "TorchFloat64Printer"]
