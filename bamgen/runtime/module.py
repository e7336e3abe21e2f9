"""The nn.Module of every prior: each generated module subclasses PriorAttention with its prior
(``class GeneralizedGaussianAttention(PriorAttention): _bamgen_prior = _prior``), so a model
pickles and reloads by the generated class's name, as any nn.Module does."""
from __future__ import annotations

import torch

from . import checks, ops
from .functional import attend
from .params import check_domains, from_domain, param_block, theta as make_theta, to_domain
from .positions import positions_of, traced_bounds


class PriorAttention(torch.nn.Module):
    """Attention with a learnable prior, one set of parameters per head.

    A learnable parameter ``x`` is stored unconstrained as ``raw_x`` and mapped into its domain
    (positive: exp, nonnegative: softplus, interval: scaled sigmoid); ``prior_params()`` returns
    the values themselves. Non-learnable parameters are buffers.
    """
    _bamgen_prior = None   # the generated subclass's bamgen.runtime.Prior

    def __init__(self, num_heads, *, init=None, device=None):
        if self._bamgen_prior is None:   # the base class itself: no prior to attend with
            raise TypeError("PriorAttention is the base class of the generated modules and has "
                            "no prior: construct a generated module's own class, such as "
                            "bamgen.load('generalized_gaussian').GeneralizedGaussianAttention"
                            "(num_heads=8)")
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        self.num_heads = num_heads
        self._bamgen_init = dict(init or {})
        if device is None:
            device = torch.get_default_device()
        for p, value in self._initial_storage():
            value = value.to(device)
            if p.learnable:
                self.register_parameter(p.storage, torch.nn.Parameter(value))
            else:
                self.register_buffer(p.storage, value)

    def _initial_storage(self):
        """[(parameter traits, its stored initial value)]: the prior's inits with the module's
        init= over them, checked in their domains, then mapped out of them (raw_x) for a
        learnable one. Made and checked on the CPU: under `with torch.device("meta")` (a large
        model built without memory, then loaded with load_state_dict(assign=True), or
        initialised by reset_parameters() after to_empty()) the factories would make meta
        tensors, whose domain check cannot read a value."""
        traits, num_heads = self._bamgen_prior.traits, self.num_heads
        with torch.device("cpu"):
            values = self._bamgen_prior.default_params(num_heads)
            for name, value in getattr(self, "_bamgen_init", {}).items():   # (older pickles: none)
                if name not in values:
                    raise ValueError(f"init: unknown parameter {name!r}; known: "
                                     f"{', '.join(traits.param_names) or 'none'}")
                try:
                    block = param_block(traits.param(name), value, num_heads, "cpu")
                except ValueError as exc:   # the attention() wording, said of init=
                    raise ValueError(f"init: {exc}") from None
                values[name] = _stored_shape(traits.param(name), block.detach().clone())
            check_domains(traits, values, what="init: ")
        stored = []
        for p in traits.params:
            value = values[p.name] if p.per_head or p.size is not None else values[p.name][:1]
            stored.append((p, from_domain(p, value) if p.learnable else value))
        return stored

    def reset_parameters(self):
        """Initialise the parameters again, in place, as the constructor did (its init= over
        the prior's inits; a random init is drawn anew): after to_empty() of a module built on
        the meta device, as FSDP's deferred initialisation calls it."""
        with torch.no_grad():
            for p, value in self._initial_storage():
                getattr(self, p.storage).copy_(value)

    def prior_params(self):
        """{name: the parameter's current value}: a scalar [num_heads] (or [1] when the heads
        share it), a vector [num_heads, size] (or [size] when the heads share it)."""
        out = {}
        for p in self._bamgen_prior.traits.params:
            stored = getattr(self, p.storage)
            out[p.name] = to_domain(p, stored) if p.learnable else stored
        return out

    def forward(self, q, k, v, *, causal=True, scale=None, q_offset=0, k_offset=0, key_mask=None,
                cu_seqlens_q=None, cu_seqlens_k=None, backend="auto", pos_q=None, pos_k=None):
        """attention() with this module's prior parameters; the arguments are attention()'s."""
        return self.forward_with(self._bamgen_prior, q, k, v, causal=causal, scale=scale,
                                 q_offset=q_offset, k_offset=k_offset, key_mask=key_mask,
                                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                 backend=backend, pos_q=pos_q, pos_k=pos_k)

    def forward_with(self, prior, q, k, v, *, causal=True, scale=None, q_offset=0, k_offset=0,
                     key_mask=None, cu_seqlens_q=None, cu_seqlens_k=None, backend="auto",
                     pos_q=None, pos_k=None):
        """forward() under another compiled prior (a generated module's ``_prior``) that declares
        the same parameters as this module's: the parameters stay this module's. The Hugging Face
        integration runs a layer's sliding window or logit softcap this way, as a prior derived
        from the user's (docs/huggingface.md, "Sliding windows and softcaps")."""
        if prior is not self._bamgen_prior and not torch.compiler.is_compiling():
            _check_same_params(prior, self._bamgen_prior)
        if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] != self.num_heads:
            raise ValueError(f"q has {q.shape[1]} heads but this module was built with "
                             f"num_heads={self.num_heads}")
        q, k, v = checks.autocast_inputs(q, k, v)
        checks.check_inputs(q, k, v, causal, scale, backend)
        via_ops = ops.through_ops(q)   # traced, or under a selective checkpoint
        if not via_ops:   # (the ops check it when they run, as eager's error)
            checks.check_causal(prior.traits, causal, pos_q, pos_k)
        theta = make_theta(prior.traits, q, self.prior_params(), grad=True)
        pos = positions_of(prior, q, k, pos_q, pos_k, q_offset, k_offset, cu_seqlens_q)
        if pos is not None and via_ops:
            return ops.attend_positional(prior, q, k, v, theta, pos.q, pos.k, causal, scale,
                                         backend, key_mask, cu_seqlens_q, cu_seqlens_k,
                                         check=False, q_offset=q_offset, k_offset=k_offset,
                                         bounds=traced_bounds(pos_q, pos_k))
        if pos is not None:
            layout = checks.layout(q, k, q_offset, k_offset, key_mask, cu_seqlens_q, cu_seqlens_k)
            return attend(prior, q, k, v, theta, causal, scale, layout, backend, pos)
        if via_ops:
            return ops.attend(prior, q, k, v, theta, causal, scale, backend, q_offset, k_offset,
                              key_mask, cu_seqlens_q, cu_seqlens_k, check=False)
        layout = checks.layout(q, k, q_offset, k_offset, key_mask, cu_seqlens_q, cu_seqlens_k)
        return attend(prior, q, k, v, theta, causal, scale, layout, backend)

    def extra_repr(self):
        return f"num_heads={self.num_heads}, prior={self._bamgen_prior.traits.name!r}"


def _stored_shape(param, block):
    """A [num_heads, width] block in the shape default_params gives: [num_heads] for a scalar,
    [num_heads, size] for a vector ([size] when the heads share it)."""
    if param.size is None:
        return block[:, 0]
    return block if param.per_head else block[0]


def _check_same_params(prior, own) -> None:
    """forward_with's prior must read this module's parameters as its own prior does."""
    if prior.traits.params != own.traits.params:
        raise ValueError(f"prior: {prior.traits.name!r} declares the parameters "
                         f"{', '.join(prior.traits.param_names) or 'none'}, this module's prior "
                         f"{own.traits.name!r} declares "
                         f"{', '.join(own.traits.param_names) or 'none'} (with their domains and "
                         f"shapes); forward_with needs the same parameters")
