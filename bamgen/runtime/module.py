"""The nn.Module of every prior: each generated module subclasses PriorAttention with its prior
(``class GeneralizedGaussianAttention(PriorAttention): _bamgen_prior = _prior``), so a model
pickles and reloads by the generated class's name, as any nn.Module does."""
from __future__ import annotations

import torch

from . import checks, ops
from .functional import attend
from .params import check_domains, from_domain, param_column, theta as make_theta, to_domain


class PriorAttention(torch.nn.Module):
    """Attention with a learnable prior, one set of parameters per head.

    A learnable parameter ``x`` is stored unconstrained as ``raw_x`` and mapped into its domain
    (positive: exp, nonnegative: softplus, interval: scaled sigmoid); ``prior_params()`` returns
    the values themselves. Non-learnable parameters are buffers.
    """
    _bamgen_prior = None   # the generated subclass's bamgen.runtime.Prior

    def __init__(self, num_heads, *, init=None, device=None):
        super().__init__()
        traits = self._bamgen_prior.traits
        self.num_heads = num_heads
        values = self._bamgen_prior.default_params(num_heads)
        for name, value in (init or {}).items():
            if name not in values:
                raise ValueError(f"init: unknown parameter {name!r}; known: "
                                 f"{', '.join(traits.param_names) or 'none'}")
            values[name] = param_column(name, value, num_heads, "cpu").detach().clone()
        check_domains(traits, values, what="init: ")
        for p in traits.params:
            value = values[p.name] if p.per_head else values[p.name][:1]
            value = value.to(device)
            if p.learnable:
                self.register_parameter("raw_" + p.name, torch.nn.Parameter(from_domain(p, value)))
            else:
                self.register_buffer(p.name, value)

    def prior_params(self):
        """{name: tensor [num_heads] or [1]} of the parameters' current values."""
        out = {}
        for p in self._bamgen_prior.traits.params:
            if p.learnable:
                out[p.name] = to_domain(p, getattr(self, "raw_" + p.name))
            else:
                out[p.name] = getattr(self, p.name)
        return out

    def forward(self, q, k, v, *, causal=True, scale=None, q_offset=0, k_offset=0, key_mask=None,
                cu_seqlens_q=None, cu_seqlens_k=None, backend="auto"):
        """attention() with this module's prior parameters; the arguments are attention()'s."""
        prior = self._bamgen_prior
        if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] != self.num_heads:
            raise ValueError(f"q has {q.shape[1]} heads but this module was built with "
                             f"num_heads={self.num_heads}")
        checks.check_inputs(q, k, v, causal, scale, backend)
        theta = make_theta(prior.traits, q, self.prior_params(), grad=True)
        if ops.tracing(q):
            return ops.attend(prior, q, k, v, theta, causal, scale, backend, q_offset, k_offset,
                              key_mask, cu_seqlens_q, cu_seqlens_k, check=False)
        layout = checks.layout(q, k, q_offset, k_offset, key_mask, cu_seqlens_q, cu_seqlens_k)
        return attend(prior, q, k, v, theta, causal, scale, layout, backend)

    def extra_repr(self):
        return f"num_heads={self.num_heads}, prior={self._bamgen_prior.traits.name!r}"
