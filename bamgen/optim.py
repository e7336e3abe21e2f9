"""Keep positional-prior parameters out of weight decay.

Weight decay pulls every parameter towards 0. For a prior's raw parameters that is a pull
towards an arbitrary prior (a positive alpha is stored as raw_alpha = log alpha, so 0 means
alpha = 1), not towards a simpler model; there are a few per head, so they cannot overfit the
way a weight matrix does. Like biases and norm weights in timm and nanoGPT, they belong in a
group with no decay. Two conventions are followed:

- torch's: optimizer parameter groups, ``AdamW(param_groups(model, 0.1), lr=...)``;
- timm's: a module's ``no_weight_decay()`` returns the names (relative to that module) of
  parameters to keep out of decay. It is honoured on every submodule, so it works for the
  generated attention modules, for timm models, and for a user's own modules.
"""
from __future__ import annotations

import numbers
import sys
import warnings

import torch


def param_groups(model: torch.nn.Module, weight_decay: float = 0.01, *,
                 prior_lr: float | None = None) -> list[dict]:
    """Parameter groups: ``weight_decay`` for everything but the prior parameters of every
    generated attention module inside ``model`` and the names any submodule lists in
    ``no_weight_decay()``, which get 0 (two groups). With ``prior_lr`` (a few scalars per head
    often want a larger learning rate) the prior parameters take it in a third group of their
    own: a timm model's ``pos_embed`` or norm weights want no decay, not the prior's rate.
    Frozen parameters and empty groups are left out."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    _check_rate("weight_decay", weight_decay)
    if prior_lr is not None:
        _check_rate("prior_lr", prior_lr)
    keep = {id(p) for p in no_decay_parameters(model)}
    _refuse_flat_parameters(model)
    priors = set()
    if prior_lr is not None:
        priors = {id(p) for module in model.modules() for p in _prior_parameters(module)
                  if p.requires_grad}
        if not priors:
            warnings.warn("prior_lr: the model has no learnable prior parameter (no generated "
                          "attention module with a learnable prior inside it), so no parameter "
                          "takes this rate", stacklevel=2)
    decay, no_decay, prior = [], [], []
    for _, param in model.named_parameters():
        if param.requires_grad:
            group = prior if id(param) in priors else no_decay if id(param) in keep else decay
            group.append(param)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0},
              {"params": prior, "weight_decay": 0.0, "lr": prior_lr}]
    return [group for group in groups if group["params"]]


def _check_rate(name: str, value) -> None:
    """A rate read from a config file may arrive as a string ("1e-3"), which torch's optimizers
    only reject at their first step, far from the call that carried it."""
    if hasattr(value, "item") and not isinstance(value, str):
        try:
            value = value.item()   # a one-element tensor or numpy array
        except (ValueError, RuntimeError):
            pass                   # (more than one element: refused below)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
        hint = "; a value from a config file needs float(...)" if isinstance(value, str) else ""
        raise ValueError(f"{name}: expected a number >= 0, got {value!r} ({type(value).__name__})"
                         f"{hint}")


def _refuse_flat_parameters(model: torch.nn.Module) -> None:
    """FSDP1 with use_orig_params=False (its default) replaces a module's parameters with one
    flat parameter per wrapped unit: the prior's few scalars sit inside the weights' flat
    tensor, so no group can give them another decay or rate. Silently, every parameter would
    decay and take the base rate."""
    if not any(getattr(p, "_is_flat_param", False) for p in model.parameters()):
        return
    if any(_generated_prior(module) is not None or callable(getattr(module, "no_weight_decay", None))
           for module in model.modules()):
        raise ValueError("model: FSDP (FullyShardedDataParallel) with use_orig_params=False "
                         "flattens the prior parameters (and the names no_weight_decay() lists) "
                         "into the other weights, so they cannot have a group of their own; "
                         "wrap with use_orig_params=True, or use FSDP2 "
                         "(torch.distributed.fsdp.fully_shard)")


def no_decay_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters :func:`param_groups` keeps out of weight decay."""
    found = []
    for module in model.modules():
        found += _prior_parameters(module)
        listed = getattr(module, "no_weight_decay", None)
        if callable(listed):
            own = dict(module.named_parameters())
            found += [own[name] for name in listed() if name in own]
    return list({id(p): p for p in found}.values())


def _generated_prior(module: torch.nn.Module):
    """The prior of ``module``'s class, if it (or a class it derives from) is a generated
    module's: its runtime Prior, or the ``PRIOR`` dict its module carries; else None. Read from
    the class, so it holds where FSDP1 has taken the module's own parameters away."""
    prior = getattr(type(module), "_bamgen_prior", None)
    if prior is not None:
        return prior
    for cls in type(module).__mro__:
        meta = getattr(sys.modules.get(cls.__module__), "PRIOR", None)
        if isinstance(meta, dict) and isinstance(meta.get("params"), dict):
            return meta
    return None


def _prior_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The stored learnable parameters of the prior (raw_<name>, or the attribute its traits
    name), if ``module`` (or a class it derives from) is a generated module's class."""
    prior = _generated_prior(module)
    if prior is None:
        return []
    if isinstance(prior, dict):
        names = [f"raw_{name}" for name in prior["params"]]
    else:
        names = [p.storage for p in prior.traits.params if p.learnable]
    own = dict(module.named_parameters(recurse=False))
    return [own[name] for name in names if name in own]
