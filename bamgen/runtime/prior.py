"""A generated module's prior, bound to the runtime: its traits, its printed hooks and the state
the runtime keeps per prior (its custom ops, its instance of the Triton kernels, its decode
tables, its autotuning choices). Every runtime function takes this object first; the
generated module binds its public functions to it (docs/architecture.md, "The generated
module")."""
from __future__ import annotations

import keyword
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from . import blocks, functional
from .cpu.decode import DecodeTables
from .ops import Ops, TritonOps, claimed_op_name, shared_ops
from .params import DomainCheck
from .traits import HOOK_HELPERS, RUNTIME_ABI, PriorTraits, position_table_traits


@dataclass(frozen=True)
class TorchHooks:
    """The prior printed for torch (the CPU path, and the host's distance tables):

    logit(s, pos_d, pos_i, pos_j, pos_n, prm) and logit_grads(...) -> (logit, d logit / d s,
    d logit / d p per learnable p) over a block of scores; distance_prior(pos_d, prm,
    with_grads=True) -> (log_prior, d log_prior / d p per traits.table_grads) over distances,
    for a prior in d alone (evaluated in float64 on the host); table_logit(s, tab_v, ...) and
    table_logit_grads(s, tab_v, tabs, ...), the logit of a score other than s + log_prior with
    the log-prior read from the distance table; position_grads(s, pos_d, ...) -> (d logit / d i_c
    per channel, then d logit / d j_c), the gradients of position tensors (with several
    channels pos_d, pos_i, pos_j are tuples, one tile per channel). prm: one tensor per
    parameter, in slot order."""
    logit: Callable
    logit_grads: Callable
    distance_prior: Optional[Callable] = None
    table_logit: Optional[Callable] = None
    table_logit_grads: Optional[Callable] = None
    position_grads: Optional[Callable] = None


def triton_hook(fn):
    """Marks a function of a generated module as one of its Triton hooks (runtime/triton/hooks.py
    lists them). It stays a plain function until the GPU path first runs: Prior.kernels() then
    compiles it with triton.jit."""
    fn.__bamgen_triton_hook__ = True
    return fn


class Prior:
    """One prior as the runtime sees it. meta: the module's PRIOR dictionary (name, formulas,
    build hash); default_params(num_heads) -> {name: float32 tensor [num_heads]}; triton_hooks:
    the module's @triton_hook functions."""

    def __init__(self, traits: PriorTraits, meta: dict, default_params: Callable,
                 torch_hooks: TorchHooks, triton_hooks=(), abi: int = RUNTIME_ABI, positional=None):
        if abi != RUNTIME_ABI:
            raise ImportError(f"the module of the prior {traits.name!r} was built for bamgen's "
                              f"runtime ABI {abi}, and this bamgen runs ABI {RUNTIME_ABI}: rebuild "
                              f"it (bamgen build, or bamgen.load, which rebuilds on its own)")
        self.traits = traits
        self.meta = meta
        self.default_params = default_params
        self.torch = torch_hooks
        self.triton_hooks = {fn.__name__: fn for fn in triton_hooks}
        self.domain_check = DomainCheck(traits)
        self.decode_tables = DecodeTables(self)
        self.tuned = {}                  # autotuned tiles (triton/launch.py)
        self._kernels = None
        self._kernels_lock = threading.Lock()
        self.op_name = claimed_op_name(meta)     # torch.ops.bamgen.<op_name>_fwd / _bwd
        self.ops = shared_ops(self, "ops", Ops)
        self.triton_ops = shared_ops(self, "triton", TritonOps) if TritonOps.wanted() else None
        # the prior as the kernels of calls with position tensors see it (docs/positions.md):
        # (traits, hooks named pos_<hook>) of the module's positional plan; a prior over several
        # channels is positional itself
        if traits.tensor_positions:
            self.positional = self
        elif positional is not None:
            self.positional = PositionalPrior(self, *positional)
        else:
            self.positional = None
        # a table prior's kernels for integer position tensors: its own table and hooks, read
        # at each score's position distance (docs/positions.md, "Integer positions")
        table_traits = position_table_traits(traits)
        self.position_table = None if table_traits is None else PositionalPrior(
            self, table_traits, triton_hooks)

    def __repr__(self):
        return f"<bamgen prior {self.traits.name!r} ({self.traits.strategy}), ops {self.op_name!r}>"

    def kernels(self):
        """This prior's instance of the Triton kernels (triton/variant.py), made on first use:
        its hooks compiled with triton.jit, `tl` and the helpers they call (traits.HOOK_HELPERS)
        bound in its module."""
        with self._kernels_lock:
            if self._kernels is None:
                import triton.language as tl

                from .triton import helpers, variant
                for fn in self.triton_hooks.values():
                    fn.__globals__.update(tl=tl, **{name: getattr(helpers, name)
                                                    for name in HOOK_HELPERS})
                self._kernels = variant.instantiate(self.traits, self.triton_hooks)
            return self._kernels

    # ---- the generated module's functions, bound to this prior
    def attention(self, q, k, v, values, *args):
        return functional.attention(self, q, k, v, values, *args)

    def forward_block(self, q, k, v, values, *args):
        return blocks.forward_block(self, q, k, v, values, *args)

    def backward_block(self, dout, q, k, v, out, stats, values, *args):
        return blocks.backward_block(self, dout, q, k, v, out, stats, values, *args)

    def finish_param_grads(self, dparams, row_sums):
        return blocks.finish_param_grads(self, dparams, row_sums)

    def log_prior_at(self, d, values, num_heads=None):
        return blocks.log_prior_at(self, d, values, num_heads)

    def keyword_params(self, function: str, given: dict) -> dict:
        """The parameters named by Python keywords (lambda, in), which no signature can list:
        the generated functions take them through **keyword_params (attention(q, k, v,
        **{"lambda": 0.5})) and pass them on from here, with the TypeErrors Python gives a
        listed keyword-only argument that is missing or unexpected."""
        names = [p.name for p in self.traits.params if keyword.iskeyword(p.name)]
        unexpected = next((name for name in given if name not in names), None)
        if unexpected is not None:
            raise TypeError(f"{function}() got an unexpected keyword argument {unexpected!r}")
        missing = [name for name in names if name not in given]
        if missing:
            listed = " and ".join(", ".join(map(repr, missing)).rsplit(", ", 1))
            raise TypeError(f"{function}() missing {len(missing)} required keyword-only "
                            f"argument{'s' if len(missing) > 1 else ''}: {listed} (a Python "
                            f"keyword is not written name=value: pass **{{{missing[0]!r}: "
                            f"value}})")
        return given

    def triton_kernel_specs(self, dtype="bf16", head_dim=64, causal=True, arch="sm_90", candidate=0,
                            layout="plain"):
        """Each Triton kernel with the signature and constexprs of one specialisation, for
        ahead-of-time compilation (``bamgen inspect`` and the AOT tests): a list of
        (name, jit function, signature, constexprs, num_warps, num_stages)."""
        from .triton import launch
        return launch.kernel_specs(self, dtype, head_dim, causal, arch, candidate, layout)


class PositionalPrior:
    """A prior's kernels for calls whose positions are tensors: its positional plan's traits
    and hooks (the generated module's pos_<hook> functions), or for integer positions its table
    plan's with position_table_traits, with the prior's own torch hooks, parameters and checks.
    The Triton launches take it where they take a Prior."""

    def __init__(self, prior: Prior, traits: PriorTraits, triton_hooks):
        self.traits = traits
        self.meta = prior.meta
        self.torch = prior.torch
        self.domain_check = prior.domain_check
        self.triton_hooks = {fn.__name__.removeprefix("pos_"): fn for fn in triton_hooks}
        self.tuned = {}
        self._kernels = None
        self._kernels_lock = threading.Lock()
        self.positional = self
        self.position_table = None

    def __repr__(self):
        what = "integer positions, table" if self.traits.table_positions else "positions as tensors"
        return f"<bamgen prior {self.traits.name!r} ({what})>"

    kernels = Prior.kernels
