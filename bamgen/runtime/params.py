"""A prior's parameters at call time: per-head columns, their domains, and ``theta``.

Parameters reach the kernels as one float32 tensor theta [Hq, P] (P = the prior's scalars in
slot order: a scalar parameter takes a column, a vector of K elements K columns) built with
torch.cat from the user's values, so that autograd carries theta's gradient back to whatever
tensors the user passed, or to the nn.Module's raw parameters through the domain maps below
(positive: exp, nonnegative: softplus, interval: scaled sigmoid). The inits of default_params
are computed here too (init_formula, init_random).
"""
from __future__ import annotations

import math
import struct
import weakref

import torch

from .traits import ParamTraits, PriorTraits


def describe_domain(param: ParamTraits) -> str:
    if param.domain == "interval":
        return f"in the open interval ({param.lo:g}, {param.hi:g})"
    return {"positive": "positive (> 0)", "nonnegative": "nonnegative (>= 0)"}.get(param.domain,
                                                                                 "a real number")


def outside_domain(param: ParamTraits, column):
    """Bool [n]: values of the parameter that its declared domain excludes (NaN and +-inf
    always: the prior is evaluated in floating point)."""
    bad = ~torch.isfinite(column)
    if param.domain == "positive":
        bad = bad | (column <= 0)
    elif param.domain == "nonnegative":
        bad = bad | (column < 0)
    elif param.domain == "interval":
        bad = bad | (column <= param.lo) | (column >= param.hi)
    return bad


def check_domains(traits: PriorTraits, columns: dict, what: str = ""):
    """Refuse parameter values outside their domains, naming the parameter (the element of a
    vector) and the head: the prior's formula is only valid there (a negative scale or a NaN
    would give NaN or silently wrong weights). columns: {name: [heads] or [heads, size] or
    [size]}. One device synchronisation for all parameters."""
    if not columns:
        return
    flags = torch.stack([outside_domain(traits.param(name), col.detach()).any()
                         for name, col in columns.items()])
    if not bool(flags.any()):
        return
    for name, col in columns.items():
        param = traits.param(name)
        values = col.detach()
        if param.size is not None and values.dim() == 1:   # a shared vector [size]: one row
            values = values[None]
        bad = outside_domain(param, values)
        if bool(bad.any()):
            where = bad.nonzero()[0].tolist()
            head = where[0]
            value = float(values[tuple(where)])
            label = name if param.size is None else f"{name}[{where[1]}]"
            raise ValueError(f"{what}{label} must be {describe_domain(param)} and finite (its "
                             f"domain in the prior file), got {value!r} for head {head}")


def init_formula(name, formula, heads, size=None, per_head=True):
    """A parameter's starting value from its init formula(h) (H bound by the caller), as
    default_params computes it: float32 [heads] for a scalar, [heads, size] for a vector
    ([size], head 0's value, for a vector shared by the heads). A head whose value cannot be
    computed (a division by zero at this head count) is named in a ValueError."""
    values = []
    for h in range(heads if (size is None or per_head) else 1):
        try:
            values.append(float(formula(h)))
        except (ArithmeticError, ValueError) as exc:
            raise ValueError(f"the init of {name} cannot be computed for head {h} of {heads} "
                             f"({type(exc).__name__}: {exc}); build the module for another "
                             f"number of heads or change the init in the prior file") from None
    column = torch.tensor(values, dtype=torch.float32)
    if size is None:
        return column
    if not per_head:
        return column.expand(size).clone()
    return column[:, None].expand(heads, size).clone()


def init_random(kind, a, b, heads, size=None, per_head=True):
    """A random starting value, drawn with torch's default generator (torch.manual_seed makes
    it reproducible): uniform on [a, b) or normal with mean a and standard deviation b. Shapes as
    init_formula's; a scalar shared by the heads draws once and repeats it."""
    if size is None:
        shape = (heads,) if per_head else (1,)
    else:
        shape = (heads, size) if per_head else (size,)
    value = torch.empty(shape, dtype=torch.float32)
    value = value.uniform_(a, b) if kind == "uniform" else value.normal_(a, b)
    return value.expand(heads).clone() if size is None and not per_head else value


class DomainCheck:
    """check_domains for the stacked parameters theta [Hq, P] of one prior: one vectorised test
    (a step of a decode loop pays a few operations, not a few per parameter), the message from
    check_domains where it fails. Keeps, per device and dtype, the bounds as tensors, and the
    bits of CPU parameter sets that passed: a decode loop passes the same values every step
    (and every torch or numpy operation costs a step 10-30 us once its K and V have swept the
    caches).

    On a GPU the test reads a value on the host, which waits for every kernel queued before it
    (a stream synchronisation). So a call that names its values (``sources``, the user's values
    in slot order) reads none when each is a Python number, tested here on the host, or a
    tensor already found in its domain and not changed since: the same object at the same
    version (``Tensor._version`` counts in-place writes, which an optimiser's step makes). A
    loop that passes the same parameter tensors, or numbers, then runs ahead of the GPU."""

    def __init__(self, traits: PriorTraits):
        self.traits = traits
        # scalars the heads share (per_head: false): given [Hq] (default_params' shape), every
        # head must hold the same value, tested in the same read as the domains
        self.shared = [p.slot for p in traits.params if p.size is None and not p.per_head]
        self.bounds = {}
        self.in_domain = set()
        self.passed = {}   # id(tensor) -> (weak reference, version) of tensors found in domain

    def _bounds(self, theta):
        """Per slot of theta, (lower open, lower closed, upper open) bounds of its domain as
        tensors [P] on theta's device: a value v is in its domain iff lo_open < v,
        lo_closed <= v and v < hi_open, which NaN and +-inf fail (lower closed is None where no
        parameter is nonnegative)."""
        key = (theta.device, theta.dtype)
        if key not in self.bounds:
            rows = []
            for p in self.traits.params:
                rows += [domain_bounds(p)] * p.width
            lo_open, lo_closed, hi_open = torch.tensor(rows, dtype=theta.dtype).T.to(theta.device).unbind(0)
            closed = any(p.domain == "nonnegative" for p in self.traits.params)
            self.bounds[key] = (lo_open, lo_closed if closed else None, hi_open)
        return self.bounds[key]

    def __call__(self, theta, what: str = "", sources=None):
        if theta.shape[1] == 0:
            return
        if sources is not None and self._known(sources):
            return
        values = theta.detach()
        seen = None
        if values.device.type == "cpu":
            seen = (values.dtype, values.shape, values.numpy().tobytes())
            if seen in self.in_domain:
                self._remember(sources)
                return
        lo_open, lo_closed, hi_open = self._bounds(theta)
        ok = (values > lo_open) & (values < hi_open)
        if lo_closed is not None:
            ok &= values >= lo_closed
        if self.shared:
            ok[:, self.shared] &= values[:, self.shared] == values[:1, self.shared]
        if not bool(ok.all()):
            check_domains(self.traits, {p.name: values[:, p.slot] if p.size is None
                                        else values[:, p.slot:p.slot + p.size]
                                        for p in self.traits.params}, what)
            self._refuse_split_shared(values, what)
        if seen is not None:
            if len(self.in_domain) >= 1024:
                self.in_domain.clear()
            self.in_domain.add(seen)
        self._remember(sources)

    def _refuse_split_shared(self, values, what):
        """A scalar the heads share, given a different value per head: each head would silently
        use its own."""
        for p in self.traits.params:
            if p.slot in self.shared and not bool((values[:, p.slot] == values[0, p.slot]).all()):
                heads = values[:, p.slot].tolist()
                shown = ", ".join(f"{v:g}" for v in heads[:4]) + (", ..." if len(heads) > 4 else "")
                raise ValueError(f"{what}{p.name} is shared by the heads (per_head: false in the "
                                 f"prior file): pass a float or a 0-d tensor, got a different "
                                 f"value per head ({shown})")

    def _known(self, sources) -> bool:
        """Whether every value is a number in its domain or a tensor that passed, unchanged."""
        for param, value in zip(self.traits.params, sources):
            if isinstance(value, torch.Tensor):
                if value.is_inference():   # (no version counter: tested every call)
                    return False
                entry = self.passed.get(id(value))
                if entry is None or entry[0]() is not value or entry[1] != value._version:
                    return False
            elif not (isinstance(value, (int, float)) and _number_in_domain(param, value)):
                return False   # (a list, or a number outside: the full test, and its message)
        return True

    def _remember(self, sources):
        """Mark the tensors among sources as passed, at their current versions."""
        for value in sources or ():
            # (an inference tensor, made under torch.inference_mode, has no version counter)
            if isinstance(value, torch.Tensor) and not value.is_inference():
                key = id(value)
                if key not in self.passed and len(self.passed) >= 1024:
                    self.passed.clear()
                self.passed[key] = (weakref.ref(value, lambda _, key=key: self.passed.pop(key, None)),
                                    value._version)


def domain_bounds(param: ParamTraits) -> tuple[float, float, float]:
    """(lower open, lower closed, upper open) bounds of the parameter's domain (DomainCheck)."""
    return {"positive": (0.0, -math.inf, math.inf),
            "nonnegative": (-math.inf, 0.0, math.inf),
            "interval": (param.lo, -math.inf, param.hi)}.get(
                param.domain, (-math.inf, -math.inf, math.inf))


def _number_in_domain(param: ParamTraits, value) -> bool:
    """Whether a number is in the parameter's domain as float32 holds it (1e-50 is 0 there, and
    1e39 overflows): the kernels' value. False sends it to the full test, and its message."""
    if isinstance(value, bool):
        return False
    value = held_as(value, torch.float32)
    lo_open, lo_closed, hi_open = domain_bounds(param)
    return lo_open < value and lo_closed <= value and value < hi_open   # (NaN: False)


def held_as(value, dtype) -> float:
    """The float a Python number becomes in dtype, as a cast gives it: float32's rounding (0
    below its smallest), and an infinity beyond the dtype's range (an int beyond any float
    too), which the domain test then names."""
    try:
        value = float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf
    if dtype != torch.float32 or not math.isfinite(value):
        return value
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def param_column(name, value, num_heads, device, dtype=torch.float32):
    """A scalar parameter as a [num_heads] tensor of dtype (float32; float64 for float64
    inputs), autograd flowing back to a tensor value: a float, a 0-d tensor, [1] or
    [num_heads]."""
    what = f"a float or a tensor of shape [{num_heads}]"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        # filled where it is used: a host tensor copied to a GPU would wait for its queue
        # (traced, the number is a symbolic float: torch.full casts it)
        value = float(value) if torch.compiler.is_compiling() else held_as(value, dtype)
        return torch.full((num_heads,), value, dtype=dtype, device=device)
    value = _as_tensor(name, value, what)
    if value.dim() > 1 or (value.numel() != 1 and value.numel() != num_heads):
        raise ValueError(f"{name} must be {what} (one value per query head), got shape "
                         f"{tuple(value.shape)}")
    value = _on(name, value, device, dtype)
    return value if value.shape == (num_heads,) else value.reshape(-1).expand(num_heads)


def param_block(param: ParamTraits, value, num_heads, device, dtype=torch.float32,
                head_rows=False):
    """A parameter's columns of theta, [num_heads, width]: a scalar as param_column takes it; a
    vector of K elements as [num_heads, K] (one row per query head), [1, K] or [K] (the same
    for every head: a vector shared by the heads is given so, and [num_heads, K] only with
    head_rows)."""
    if param.size is None:
        return param_column(param.name, value, num_heads, device, dtype)[:, None]
    size = param.size
    what = (f"a tensor of shape [{num_heads}, {size}] (a row per query head) or [{size}]"
            if param.per_head else f"a tensor of shape [{size}] (shared by the heads)")
    value = _as_tensor(param.name, value, what)
    # (compared dimension by dimension: under torch.compile a size may be symbolic, and a
    # torch.Size tested for membership in a tuple of tuples does not trace)
    shape = tuple(value.shape)
    rows = shape[0] if len(shape) == 2 else None
    # (a vector the heads share takes no row per head: its heads would silently differ)
    # (head_rows: the block API, whose caller, the ring, holds every parameter per head)
    heads_ok = rows == 1 or ((param.per_head or head_rows) and rows == num_heads)
    if not (shape[-1:] == (size,) and (len(shape) == 1 or heads_ok)):
        got = f"{value.item()!r}, one number" if not shape else f"shape {shape}"
        raise ValueError(f"{param.name} must be {what}, got {got} (a vector of {size} elements: "
                         f"e.g. torch.full(({size},), x) for one value in every element)")
    value = _on(param.name, value, device, dtype)
    return value if rows == num_heads else value.reshape(1, size).expand(num_heads, size)


def _as_tensor(name, value, what):
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    if isinstance(value, (int, float)):
        return torch.tensor(float(value), dtype=torch.float64)
    if isinstance(value, (list, tuple)):
        try:
            return torch.tensor(value, dtype=torch.float32)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be {what}, got {value!r}") from None
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be {what}, got {type(value).__name__}")
    if not value.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {value.dtype}")
    return value


def _on(name, value, device, dtype):
    """value in the call's dtype on q's device (a parameter on another device is moved, as a
    float is made a tensor; one on the meta device holds no value to move)."""
    if value.dtype != dtype or value.device != torch.device(device):   # (a decode step: already so)
        if value.device.type == "meta" and torch.device(device).type != "meta":
            raise ValueError(f"{name} is on the meta device, which holds no values; pass it on "
                             f"{device}, where q is, or as a float")
        value = value.to(device=device, dtype=dtype)
    return value


def theta(traits: PriorTraits, q, values, grad, check=None, head_rows=False):
    """The parameters as one float32 [Hq, P] tensor (float64 for float64 inputs) in slot order;
    autograd flows back to the learnable ones when grad is true. check (a DomainCheck): refuse
    values outside their domains (the nn.Module skips it: its values are in their domains by
    construction, and a NaN from a diverged optimiser step propagates to the output as NaN)."""
    num_heads = q.shape[1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if not traits.params:
        return torch.empty(num_heads, 0, dtype=dtype, device=q.device)
    blocks = []
    for p in traits.params:
        block = param_block(p, values[p.name], num_heads, q.device, dtype, head_rows)
        blocks.append(block if p.learnable else block.detach())   # a buffer: no gradient
    stacked = torch.cat(blocks, dim=1)
    if check is not None:
        check(stacked, sources=[values[p.name] for p in traits.params])
    return stacked if grad else stacked.detach()


def dtheta(traits: PriorTraits, theta, dparams):
    """theta's gradient: the learnable parameters' columns of dparams, 0 for the others."""
    if not traits.params:
        return torch.zeros_like(theta)
    dparams = dparams.to(theta.dtype)
    return torch.cat([dparams[:, p.grad_slot:p.grad_slot + p.width] if p.learnable
                      else theta.new_zeros(theta.shape[0], p.width) for p in traits.params], dim=1)


def grads_by_name(traits: PriorTraits, dparams) -> dict:
    """{learnable name: [Hq] for a scalar, [Hq, size] for a vector} from the gradient columns."""
    return {name: dparams[:, p.grad_slot] if p.size is None
            else dparams[:, p.grad_slot:p.grad_slot + p.size]
            for name in traits.learnable for p in (traits.param(name),)}


def to_domain(param: ParamTraits, raw):
    """A learnable parameter's value from its unconstrained raw value."""
    if param.domain == "positive":
        return torch.exp(raw)
    if param.domain == "nonnegative":
        return torch.nn.functional.softplus(raw)
    if param.domain == "interval":
        return param.lo + (param.hi - param.lo) * torch.sigmoid(raw)
    return raw


def from_domain(param: ParamTraits, value):
    """The unconstrained raw value of a learnable parameter's value (to_domain's inverse)."""
    if param.domain == "positive":
        return torch.log(value)
    if param.domain == "nonnegative":
        value = value.clamp_min(1e-6)
        return value + torch.log(-torch.expm1(-value))
    if param.domain == "interval":
        unit = ((value - param.lo) / (param.hi - param.lo)).clamp(1e-6, 1 - 1e-6)
        return torch.log(unit) - torch.log1p(-unit)
    return value.clone()


def element_at(index, elements, where=torch.where):
    """w[index] for a vector's elements (the torch side of a printed gather, the Triton kernels'
    is helpers._element): w[0] below 1 (and for NaN), w[k] from k on, so an index is clamped
    into [0, K - 1] (docs/priors.md, "Vectors"). Tensors of one dtype take one gather (a table
    of T5's 32 buckets is built in a few launches, not a hundred); anything else the chain of
    selects, which is its definition (the same values: a selection, no arithmetic)."""
    if (where is torch.where and len(elements) > 2 and isinstance(index, torch.Tensor)
            and index.is_floating_point()
            and all(isinstance(e, torch.Tensor) and e.dtype == elements[0].dtype for e in elements)):
        return _gathered(index, elements)
    out = elements[0]
    for k in range(1, len(elements)):
        out = where(index >= float(k), elements[k], out)
    return out


def _gathered(index, elements):
    """element_at by one gather: the largest k <= index, clamped into [0, K - 1], NaN at 0."""
    table = torch.stack(torch.broadcast_tensors(*elements), -1)            # [..., K]
    k = torch.nan_to_num(index, nan=0.0, posinf=len(elements) - 1.0, neginf=0.0)
    k = torch.floor(k).clamp(0, len(elements) - 1).to(torch.int64)
    shape = torch.broadcast_shapes(k.shape, table.shape[:-1])
    picked = torch.gather(table.expand(*shape, len(elements)), -1, k.expand(shape).unsqueeze(-1))
    return picked.squeeze(-1)


# An index's floor and ceiling (a vector's element, w[e]: docs/priors.md, "Vectors") snap a
# float64 value within INDEX_SNAP of an integer, relative to max(1, |x|), to that integer: a
# bucket boundary is where the exact value is an integer, and float64 lands a few ulps to either
# side of it depending on the order of the operations.
INDEX_SNAP = 1e-12


def index_floor(x):
    """floor(x) of an index, in float64, a near-integer snapped to it (the torch side of a
    printed index; the Triton kernels' is helpers._index_floor)."""
    nearest = torch.round(x)
    near = torch.abs(x - nearest) <= INDEX_SNAP * torch.clamp(torch.abs(x), min=1.0)
    return torch.where(near, nearest, torch.floor(x))


def index_ceil(x):
    """ceiling(x) of an index, as index_floor."""
    nearest = torch.round(x)
    near = torch.abs(x - nearest) <= INDEX_SNAP * torch.clamp(torch.abs(x), min=1.0)
    return torch.where(near, nearest, torch.ceil(x))
