"""A prior's parameters at call time: per-head columns, their domains, and ``theta``.

Parameters reach the kernels as one float32 tensor theta [Hq, P] (P = the prior's parameters, in
slot order) built with torch.stack from the user's values, so that autograd carries theta's
gradient back to whatever tensors the user passed, or to the nn.Module's raw parameters through
the domain maps below (positive: exp, nonnegative: softplus, interval: scaled sigmoid).
"""
from __future__ import annotations

import math

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
    """Refuse parameter values outside their domains, naming the parameter: the prior's formula
    is only valid there (a negative scale or a NaN would give NaN or silently wrong weights).
    One device synchronisation for all parameters."""
    if not columns:
        return
    flags = torch.stack([outside_domain(traits.param(name), col.detach()).any()
                         for name, col in columns.items()])
    if not bool(flags.any()):
        return
    for name, col in columns.items():
        param = traits.param(name)
        bad = outside_domain(param, col.detach())
        if bool(bad.any()):
            head = int(bad.nonzero()[0, 0])
            value = float(col.detach()[head])
            raise ValueError(f"{what}{name} must be {describe_domain(param)} and finite (its domain "
                             f"in the prior file), got {value!r} for head {head}")


class DomainCheck:
    """check_domains for the stacked parameters theta [Hq, P] of one prior: one vectorised test
    (a step of a decode loop pays a few operations, not a few per parameter), the message from
    check_domains where it fails. Keeps, per device and dtype, the bounds as tensors, and the
    bits of CPU parameter sets that passed: a decode loop passes the same values every step
    (and every torch or numpy operation costs a step 10-30 us once its K and V have swept the
    caches)."""

    def __init__(self, traits: PriorTraits):
        self.traits = traits
        self.bounds = {}
        self.in_domain = set()

    def _bounds(self, theta):
        """Per slot of theta, (lower open, lower closed, upper open) bounds of its domain as
        tensors [P] on theta's device: a value v is in its domain iff lo_open < v,
        lo_closed <= v and v < hi_open, which NaN and +-inf fail (lower closed is None where no
        parameter is nonnegative)."""
        key = (theta.device, theta.dtype)
        if key not in self.bounds:
            rows = []
            for p in self.traits.params:
                rows.append({"positive": (0.0, -math.inf, math.inf),
                             "nonnegative": (-math.inf, 0.0, math.inf),
                             "interval": (p.lo, -math.inf, p.hi)}.get(
                                 p.domain, (-math.inf, -math.inf, math.inf)))
            lo_open, lo_closed, hi_open = torch.tensor(rows, dtype=theta.dtype).T.to(theta.device).unbind(0)
            closed = any(p.domain == "nonnegative" for p in self.traits.params)
            self.bounds[key] = (lo_open, lo_closed if closed else None, hi_open)
        return self.bounds[key]

    def __call__(self, theta, what: str = ""):
        if theta.shape[1] == 0:
            return
        values = theta.detach()
        seen = None
        if values.device.type == "cpu":
            seen = (values.dtype, values.shape, values.numpy().tobytes())
            if seen in self.in_domain:
                return
        lo_open, lo_closed, hi_open = self._bounds(theta)
        ok = (values > lo_open) & (values < hi_open)
        if lo_closed is not None:
            ok &= values >= lo_closed
        if not bool(ok.all()):
            check_domains(self.traits, {p.name: values[:, p.slot] for p in self.traits.params}, what)
        if seen is not None:
            if len(self.in_domain) >= 1024:
                self.in_domain.clear()
            self.in_domain.add(seen)


def param_column(name, value, num_heads, device, dtype=torch.float32):
    """A parameter as a [num_heads] tensor of dtype (float32; float64 for float64 inputs), autograd
    flowing back to a tensor value."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{name} must be a float or a tensor of shape [{num_heads}], got {value!r}")
    if isinstance(value, (int, float)):
        return torch.full((num_heads,), float(value), dtype=dtype, device=device)
    if isinstance(value, (list, tuple)):
        try:
            value = torch.tensor([float(x) for x in value], dtype=torch.float32)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a float or a tensor of shape [{num_heads}], got "
                             f"{value!r}") from None
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a float or a tensor of shape [{num_heads}], got {type(value).__name__}")
    if value.dim() > 1 or (value.numel() != 1 and value.numel() != num_heads):
        raise ValueError(f"{name} must be a float or a tensor of shape [{num_heads}] "
                         f"(one value per query head), got shape {tuple(value.shape)}")
    if not value.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {value.dtype}")
    if value.dtype != dtype or value.device != torch.device(device):   # (a decode step: already so)
        value = value.to(device=device, dtype=dtype)
    return value if value.shape == (num_heads,) else value.reshape(-1).expand(num_heads)


def theta(traits: PriorTraits, q, values, grad, check=None):
    """The parameters as one float32 [Hq, P] tensor (float64 for float64 inputs) in slot order;
    autograd flows back to the learnable ones when grad is true. check (a DomainCheck): refuse
    values outside their domains (the nn.Module skips it: its values are in their domains by
    construction, and a NaN from a diverged optimiser step propagates to the output as NaN)."""
    num_heads = q.shape[1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if not traits.params:
        return torch.zeros(num_heads, 0, dtype=dtype, device=q.device)
    columns = []
    for p in traits.params:
        column = param_column(p.name, values[p.name], num_heads, q.device, dtype)
        columns.append(column if p.learnable else column.detach())   # a buffer: no gradient
    stacked = torch.stack(columns, dim=1)
    if check is not None:
        check(stacked)
    return stacked if grad else stacked.detach()


def dtheta(traits: PriorTraits, theta, dparams):
    """theta's gradient: the learnable parameters' columns of dparams, 0 for the others."""
    if not traits.params:
        return torch.zeros_like(theta)
    zero = theta.new_zeros(theta.shape[0])
    return torch.stack([dparams[:, p.grad_slot] if p.learnable else zero for p in traits.params],
                       dim=1)


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
