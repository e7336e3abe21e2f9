"""bamgen's runtime: everything that is the same for every prior, written once and tested once.

A generated module holds its prior alone (PRIOR, default_params, the hooks printed from its
formula, its frozen PriorTraits) and binds it here: ``Prior`` ties them together, and the
module's ``attention``, ``<Name>Attention`` (a subclass of ``PriorAttention``), block API and
custom ops are that prior's view of this package (docs/architecture.md, "The runtime").

    traits.py      PriorTraits, ParamTraits: what the compiler knows, as fields (no torch)
    prior.py       Prior, TorchHooks, triton_hook: the binding
    checks.py      argument checks and the layout (offsets, key_mask, packed documents)
    params.py      parameters: per-head columns, domains, theta
    tables.py      the prior per distance (float64, torch's build) and the key counts n
    cpu/           the torch path: forward, backward, decode step
    triton/        the Triton kernels (written once, the prior entering as hooks) and launches
    autograd.py    the backend dispatch and the autograd Function
    ops.py         torch.library custom ops and triton ops (torch.compile, export, torch.func)
    functional.py  attention()
    positions.py   positions as tensors: grid() and the checks of pos_q / pos_k
    blocks.py      forward_block, backward_block, finish_param_grads, log_prior_at
    module.py      PriorAttention, the nn.Module base class
"""
from .traits import GRAD_CLAMPED, GRAD_LOGIT_FACTOR, GRAD_TABLE, RUNTIME_ABI, ParamTraits, PriorTraits

__all__ = ["GRAD_CLAMPED", "GRAD_LOGIT_FACTOR", "GRAD_TABLE", "ParamTraits", "Prior", "PriorAttention",
           "PriorTraits", "RUNTIME_ABI", "TorchHooks", "element_at", "grid", "index_ceil", "index_floor", "init_formula", "init_random", "triton_hook"]

_TORCH_SIDE = {"Prior": "prior", "TorchHooks": "prior", "triton_hook": "prior",
               "PriorAttention": "module", "init_formula": "params", "init_random": "params",
               "element_at": "params", "index_floor": "params", "index_ceil": "params",
               "grid": "positions"}


def __getattr__(name):
    """The names that import torch, on first use: the compiler imports traits.py alone."""
    if name in _TORCH_SIDE:
        import importlib
        value = getattr(importlib.import_module(f".{_TORCH_SIDE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
