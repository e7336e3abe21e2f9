"""attention(): the functional form of every prior's attention (each generated module binds it
with its parameters' names, docs/architecture.md "The generated module")."""
from __future__ import annotations

import math

import torch

from . import autograd, checks, ops
from .params import theta as make_theta
from .positions import positions_of, traced_bounds


def attention(prior, q, k, v, values, causal=True, scale=None, q_offset=0, k_offset=0,
              key_mask=None, cu_seqlens_q=None, cu_seqlens_k=None, backend="auto", pos_q=None,
              pos_k=None):
    """softmax_j(logit_ij) @ v with the prior's logit; values: {parameter name: float or tensor
    [Hq]}. The arguments and the result are the generated module's attention()'s."""
    q, k, v = checks.autocast_inputs(q, k, v)
    checks.check_inputs(q, k, v, causal, scale, backend)
    via_ops = ops.through_ops(q)   # traced, or under a selective checkpoint
    if not via_ops:   # (the ops check it when they run, as eager's error)
        checks.check_causal(prior.traits, causal, pos_q, pos_k)
    pos = positions_of(prior, q, k, pos_q, pos_k, q_offset, k_offset, cu_seqlens_q)
    if pos is not None and via_ops:   # the positional custom ops check at run time
        theta = make_theta(prior.traits, q, values, grad=True)
        return ops.attend_positional(prior, q, k, v, theta, pos.q, pos.k, causal, scale, backend,
                                     key_mask, cu_seqlens_q, cu_seqlens_k, check=True,
                                     q_offset=q_offset, k_offset=k_offset,
                                     bounds=traced_bounds(pos_q, pos_k))
    if pos is not None:
        layout = checks.layout(q, k, q_offset, k_offset, key_mask, cu_seqlens_q, cu_seqlens_k)
        theta = make_theta(prior.traits, q, values, grad=True, check=prior.domain_check)
        return attend(prior, q, k, v, theta, causal, scale, layout, backend, pos)
    if via_ops:   # traced, or a selective checkpoint's region: the ops check at run time
        theta = make_theta(prior.traits, q, values, grad=True)
        return ops.attend(prior, q, k, v, theta, causal, scale, backend, q_offset, k_offset,
                          key_mask, cu_seqlens_q, cu_seqlens_k, check=True)
    layout = checks.layout(q, k, q_offset, k_offset, key_mask, cu_seqlens_q, cu_seqlens_k)
    theta = make_theta(prior.traits, q, values, grad=True, check=prior.domain_check)
    return attend(prior, q, k, v, theta, causal, scale, layout, backend)


def attend(prior, q, k, v, theta, causal, scale, layout, backend, pos=None):
    """attention() after its checks, theta built: the autograd Function on the chosen backend.
    pos: the call's Positions (bamgen/runtime/positions.py), or None."""
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    use_triton = autograd.use_triton(q, backend)
    if pos is not None:
        if use_triton and prior.positional is None:
            raise ValueError(f"pos_q: the module of the prior {prior.traits.name!r} was built "
                             f"without the kernels for position tensors; rebuild it (bamgen build)")
        if not torch.is_grad_enabled() or not any(
                t.requires_grad for t in (q, k, v, theta, pos.q, pos.k)):
            if q.numel() == 0 or k.shape[2] == 0:
                return torch.zeros_like(q, memory_format=torch.contiguous_format)
            return autograd.unviewed(autograd.positional_forward(
                prior, q, k, v, theta, (pos.q, pos.k), causal, scale, layout, use_triton, False,
                False, pos.extent)[0])
        return autograd.PositionalAttention.apply(prior, q, k, v, theta, pos.q, pos.k, causal,
                                                  scale, layout, use_triton, pos.extent)
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (q, k, v, theta)):
        # no graph to record (inference, a decode step): the forward alone, without the autograd
        # Function's bookkeeping, which costs a decode step of a small model a tenth of its time
        if q.numel() == 0 or k.shape[2] == 0:
            return torch.zeros_like(q, memory_format=torch.contiguous_format)
        return autograd.unviewed(autograd.forward(prior, q, k, v, theta, causal, scale, layout,
                                                  use_triton, False, stats=False)[0])
    return autograd.PriorAttention.apply(prior, q, k, v, theta, causal, scale, layout, use_triton,
                                         True)
