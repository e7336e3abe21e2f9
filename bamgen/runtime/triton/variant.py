"""A prior's instance of the library kernels: the kernels of helpers.py, forward.py, backward.py,
decode.py and table.py, with the prior's flags and hooks (hooks.py) in the place of the defaults.

The kernels find the hooks and flags by name in their globals. Each prior gets copies of the
library's @triton.jit functions (the same code objects) whose globals are one namespace: the
library modules' globals, then the prior's flags (tl.constexpr values from its PriorTraits)
and its hooks (the generated module's @triton_hook functions, compiled with triton.jit). Triton
compiles what that namespace names, hashes it into each kernel's cache key, and so does
inductor when torch.compile re-emits a kernel's source (docs/architecture.md, "Hooks").
"""
from __future__ import annotations

import types
from dataclasses import dataclass

import triton
import triton.language as tl

from ..traits import PriorTraits
from . import backward, decode, forward, helpers, hooks, table

LIBRARY = (hooks, helpers, forward, backward, decode, table)   # in the order their names overlay
KERNELS = {"fwd": "_attn_fwd", "preprocess": "_bwd_preprocess", "bwd_dkdv": "_attn_bwd_dkdv",
           "bwd_dq": "_attn_bwd_dq", "decode": "_attn_decode", "combine": "_decode_combine",
           "table_shift": "_table_shift_parts", "table": "_distance_table"}


def flags(traits: PriorTraits) -> dict:
    """hooks.py's flags for a prior, as tl.constexpr values."""
    values = dict(
        SCORE_IS_S=traits.score_is_s, HAS_BIAS=traits.has_bias, TABLE=traits.table,
        TABLE_SLOTS=1 + len(traits.table_grads), TABLE_WIDTH=traits.table_width,
        RAMP=traits.ramp, RAMP_SYMMETRIC=traits.ramp_symmetric, ROW_FACTORS=traits.row_factors,
        ROW_CACHE=traits.row_cache, LOGIT_FMA=traits.logit_fma, SKIP=traits.skip is not None,
        GRAD_MODES=tuple(traits.grad_modes), TILE_ROW_SUMS=traits.tile_row_sums,
        CENTER_GRADS=traits.center_grads, CLAMP_POSITIONS=traits.clamp_positions,
        POSITIONS=traits.channels if traits.tensor_positions else 0,
        TABLE_POSITIONS=traits.table_positions, ROWS_READY=traits.rows_ready,
        POSITION_GRADS=traits.position_grads,
        SCALED_SCORE=traits.score_is_s and not (traits.has_bias or traits.table or traits.ramp))
    assert set(values) == set(hooks.FLAGS)
    return {name: tl.constexpr(value) for name, value in values.items()}


def _is_jit(obj) -> bool:
    """A @triton.jit function (a JITFunction, or the interpreter's InterpretedFunction)."""
    return isinstance(obj, triton.runtime.jit.KernelInterface) and hasattr(obj, "fn")


def _jit_options(obj) -> dict:
    """The options a library kernel was decorated with, to decorate its copy alike."""
    dns = getattr(obj, "do_not_specialize", None)
    if dns is None:   # the interpreter keeps them as the decorator's keyword arguments
        dns = getattr(obj, "kwargs", {}).get("do_not_specialize")
    if not dns:
        return {}
    names = list(obj.arg_names) if hasattr(obj, "arg_names") else []
    # JITFunction keeps argument indices; the decorator takes names or indices alike
    return {"do_not_specialize": [names[i] if isinstance(i, int) and names else i for i in dns]}


@dataclass(frozen=True)
class KernelVariant:
    """One prior's kernels: name (KERNELS' keys) -> the kernel, and the namespace they share."""
    kernels: dict
    namespace: dict

    def __getitem__(self, name):
        return self.kernels[name]


def instantiate(traits: PriorTraits, prior_hooks: dict) -> KernelVariant:
    """The library kernels with this prior's flags and hooks ({hook name: plain function from
    the generated module}: each is compiled with triton.jit here)."""
    namespace = {}
    for module in LIBRARY:
        namespace.update(vars(module))
    namespace.update(flags(traits))
    for name in hooks.HOOKS:
        if name in prior_hooks:
            namespace[name] = triton.jit(prior_hooks[name])
    for module in LIBRARY:
        for name, obj in vars(module).items():
            if _is_jit(obj) and name not in hooks.HOOKS and obj.fn.__module__ == module.__name__:
                fn = obj.fn
                copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__,
                                          fn.__closure__)
                copy.__qualname__, copy.__doc__ = fn.__qualname__, fn.__doc__
                copy.__module__ = fn.__module__
                # the tl.constexpr annotations are the function's, not its code's: without them
                # a launch passes BLOCK_M, CAUSAL, DOT_PREC... as runtime arguments
                copy.__annotations__ = dict(fn.__annotations__)
                copy.__kwdefaults__ = fn.__kwdefaults__
                namespace[name] = triton.jit(**_jit_options(obj))(copy)
    return KernelVariant({key: namespace[name] for key, name in KERNELS.items()}, namespace)
