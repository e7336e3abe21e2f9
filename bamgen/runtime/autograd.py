"""The two backends behind one call, and the autograd Function of an eager call: the forward
dispatch (Triton on CUDA, the torch path on the CPU, each backend's decode step where a call is
one), and the backward that routes to the same backend with what its forward saved."""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from .cpu import backward as cpu_backward
from .cpu import decode as cpu_decode
from .cpu import forward as cpu_forward
from .params import dtheta as make_dtheta
from .triton import interpreting


def use_triton(q, backend) -> bool:
    """Whether a call runs the Triton kernels (CUDA tensors, or backend="triton" under
    TRITON_INTERPRET=1), naming the argument where the request cannot be met."""
    if backend == "torch":
        return False
    if backend == "triton":
        if not (q.is_cuda or interpreting()):
            raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for "
                             "debugging on the CPU); use backend='torch' or 'auto' on the CPU")
        if q.dtype == torch.float64:
            raise ValueError("backend='triton' has no float64 kernels: q, k, v are float64; use "
                             "backend='torch' (float64 end to end) or float32")
        return True
    return q.is_cuda and q.dtype != torch.float64   # float64 runs on the torch path


@contextlib.contextmanager
def autocast_off():
    """torch.autocast off on every device where it is on: the kernels' inputs are already in
    the autocast dtype (checks.autocast_inputs), and the torch path's own float32 arithmetic
    (its score matmuls, the accumulator it adds P @ V into in place) must stay float32. Under
    autocast those matmuls ran in bfloat16, and a logit that is not s + f(d) (BAM-SSMax, a
    softcapped window as Gemma 2's layers run) failed in baddbmm_ ('Input dtypes must be the
    same')."""
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def outside_autocast(fn):
    """Run ``fn`` with torch.autocast off (autocast_off)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with autocast_off():
            return fn(*args, **kwargs)
    return wrapper


@outside_autocast
def forward(prior, q, k, v, theta, causal, scale, layout, use_triton, for_backward, stats=True):
    """(out, then what the backend's backward needs) of one call: Triton's (stats, out32,
    table) or the torch path's (stats,). A call with no backward to follow takes the backend's
    decode step where it is one (a few rows: the split-KV kernels, cpu.decode). stats=False:
    the caller keeps only out, and a CPU decode step may return (out,)."""
    if use_triton:
        from .triton import launch
        return launch.forward(prior, q, k, v, theta, causal, scale, layout.q_offset, layout.k_offset,
                              for_backward=for_backward, **layout.masks())
    step = None if for_backward else cpu_decode.decode(prior, q, k, v, theta, causal, scale, layout,
                                                       stats)
    return step if step is not None else cpu_forward.forward(
        prior, q, k, v, theta, causal, scale, layout.q_offset, layout.k_offset, **layout.masks())


@outside_autocast
def backward(prior, use_triton, dout, q, k, v, out, saved, theta, causal, scale, layout):
    """(dq, dk, dv, dparams) of one forward, from what it saved."""
    if use_triton:
        from .triton import launch
        return launch.backward(prior, dout, q, k, v, out, *saved, theta, causal, scale,
                               layout.q_offset, layout.k_offset, **layout.masks())
    return cpu_backward.backward(prior, dout, q, k, v, out, *saved, theta, causal, scale,
                                 layout.q_offset, layout.k_offset, **layout.masks())


SECOND_DERIVATIVE = (
    "bamgen's attention has no second derivative: a gradient taken with create_graph=True "
    "(double backward, a gradient penalty, torch.autograd.functional.hessian, torch.func.grad "
    "of a grad) cannot be differentiated through it. Take first-order gradients only "
    "(create_graph=False), or compute that part of the model with a materialised bias and "
    "torch's own softmax.")


class _NoSecondDerivative(torch.autograd.Function):
    """The identity on a backward's gradients (the first `count` tensors), connected to the
    tensors the gradients depend on (the rest), whose own backward raises SECOND_DERIVATIVE:
    the gradients of a create_graph=True backward, so that differentiating them, by
    .backward() or by torch.autograd.grad / torch.func.grad towards any input, stops there."""
    generate_vmap_rule = True   # (torch.func.grad runs backwards with create_graph: vmap, jacrev)

    @staticmethod
    def forward(count, *tensors):
        # (copies, not views: a caller may change a gradient in place, dq.mul_(0.5), which a
        # custom Function's view output refuses)
        return tuple(t.clone() for t in tensors[:count])

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(SECOND_DERIVATIVE)


def first_order(backward_fn):
    """An autograd Function's backward whose gradients cannot be differentiated again: with
    create_graph=True (grad mode on in the backward) its gradients come back through
    _NoSecondDerivative, which raises SECOND_DERIVATIVE when a second derivative reaches it,
    instead of as constants, which made every second derivative through the attention a
    silent 0 (a gradient penalty dropped, a Hessian of zeros)."""
    @functools.wraps(backward_fn)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward_fn(ctx, *grads)
        if not torch.is_grad_enabled():
            return outputs
        depends = [t for t in (*ctx.saved_tensors, *grads)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        at = [i for i, g in enumerate(outputs) if isinstance(g, torch.Tensor)]
        if not depends or not at:
            return outputs
        raised = _NoSecondDerivative.apply(len(at), *(outputs[i] for i in at), *depends)
        outputs = list(outputs)
        for i, g in zip(at, raised):
            outputs[i] = g
        return tuple(outputs)
    return wrapper


def unviewed(out):
    """out, a view of the backend's [B, Hk, G, N, D] buffer (the query heads grouped by their
    key head), as a tensor of its own over the same memory: an autograd Function's view output
    refused an in-place edit of the result ('Output 0 of PriorAttentionBackward is a view'), and
    FSDP2 warns of a view returned by a wrapped module. The edit is then caught where the
    backward needs the saved result, as for any saved output. (The calls without a graph
    return it too: the same result whether or not grad is on.)"""
    return out.detach() if out._base is not None else out


class PriorAttention(torch.autograd.Function):
    """Attention with a prior's logit; gradients for q, k, v and the parameter tensor theta."""

    @staticmethod
    def forward(ctx, prior, q, k, v, theta, causal, scale, layout, use_triton, grad_mode):
        if q.numel() == 0 or k.shape[2] == 0:   # no query, or no key: every row is 0
            ctx.empty = True
            ctx.save_for_backward(q, k, v, theta)
            return torch.zeros_like(q, memory_format=torch.contiguous_format)
        ctx.empty = False
        # Each backend saves what its own backward needs after `out` (the softmax statistics,
        # and for Triton a float32 copy of O when training in fp16/bf16 and the prior's table).
        # grad_mode: the caller's torch.is_grad_enabled() (always False in here); under no_grad
        # the inputs may still require grad, but no backward follows
        for_backward = grad_mode and any(ctx.needs_input_grad[1:5])
        out, *saved = forward(prior, q, k, v, theta.detach(), causal, scale, layout, use_triton,
                              for_backward)
        out = unviewed(out)
        ctx.save_for_backward(q, k, v, theta, out, *saved)
        ctx.settings = (prior, causal, scale, layout, use_triton)
        return out

    @staticmethod
    @first_order
    def backward(ctx, dout):
        if ctx.empty:
            return (None, *(torch.zeros_like(t) for t in ctx.saved_tensors), None, None, None, None,
                    None)
        q, k, v, theta, out, *saved = ctx.saved_tensors
        prior, causal, scale, layout, use_triton = ctx.settings
        dq, dk, dv, dparams = backward(prior, use_triton, dout, q, k, v, out, saved,
                                       theta.detach(), causal, scale, layout)
        dtheta = None
        if ctx.needs_input_grad[4]:
            dtheta = make_dtheta(prior.traits, theta, dparams)
        return None, dq, dk, dv, dtheta, None, None, None, None, None


def decide_positions(prior, pos, position_grads, use_triton, extent=None):
    """pos as the backend takes it: for Triton, its kernels' way with them decided
    (launch.position_call: a table prior may read its table at integer positions, which takes
    a host read unless extent, Positions.extent, gives what it reads), once for a forward and
    its backward; the CPU takes them as they are."""
    if not use_triton:
        return pos
    from .triton import launch
    return launch.decided(prior, pos, position_grads, extent)


@outside_autocast
def positional_forward(prior, q, k, v, theta, pos, causal, scale, layout, use_triton,
                       for_backward, position_grads=True, extent=None):
    """(out, then what the backend's backward needs) of a call with position tensors pos
    (docs/positions.md; no decode step), or for Triton, pos as decide_positions made it; layout:
    its int offsets (token order, for the causal mask: a chunk of rows after a cache), key_mask
    and documents. position_grads: whether a backward will want the positions' gradients (else
    the Triton kernels may read a table prior at integer positions, launch.position_call);
    extent: Positions.extent."""
    if use_triton:
        from .triton import launch
        pos = launch.decided(prior, pos, position_grads, extent)
        return launch.forward(prior, q, k, v, theta, causal, scale, layout.q_offset,
                              layout.k_offset, for_backward=for_backward, pos=pos,
                              position_grads=position_grads, **layout.masks())
    return cpu_forward.forward(prior, q, k, v, theta, causal, scale, layout.q_offset,
                               layout.k_offset, pos=pos, **layout.masks())


class PositionalAttention(torch.autograd.Function):
    """Attention whose positions are tensors (docs/positions.md): gradients for q, k, v, theta
    and the positions pos_q, pos_k ([B, Hq, N, C]), these in closed form, the row and column
    sums of dS * d logit / d i and dS * d logit / d j, on either backend."""

    @staticmethod
    def forward(ctx, prior, q, k, v, theta, pos_q, pos_k, causal, scale, layout, use_triton,
                extent=None):
        ctx.settings = (prior, causal, scale, layout, use_triton)
        if q.numel() == 0 or k.shape[2] == 0:   # no query, or no key: every row is 0
            ctx.empty = True
            ctx.save_for_backward(q, k, v, theta, pos_q, pos_k)
            return torch.zeros_like(q, memory_format=torch.contiguous_format)
        ctx.empty = False
        ctx.position_grads = any(ctx.needs_input_grad[5:7])
        # decided once: the backward takes the forward's kernels and table without a host read
        pos = decide_positions(prior, (pos_q.detach(), pos_k.detach()), ctx.position_grads,
                               use_triton, extent)
        # (Triton's choice; inline, its positions are the inputs, which the backward takes as
        # saved, checked for in-place writes; a table's are moved copies, our own)
        ctx.position_call = None
        if use_triton:
            ctx.position_call = pos if pos.span is not None else dataclasses.replace(pos, pos=None)
        out, *saved = positional_forward(prior, q, k, v, theta.detach(), pos, causal, scale,
                                         layout, use_triton, True, ctx.position_grads)
        out = unviewed(out)
        ctx.save_for_backward(q, k, v, theta, pos_q, pos_k, out, *saved)
        return out

    @staticmethod
    @first_order
    def backward(ctx, dout):
        if ctx.empty:
            return (None, *(torch.zeros_like(t) for t in ctx.saved_tensors), None, None, None,
                    None, None)
        q, k, v, theta, pos_q, pos_k, out, *saved = ctx.saved_tensors
        prior, causal, scale, layout, use_triton = ctx.settings
        pos = (pos_q.detach(), pos_k.detach())
        if ctx.position_call is not None:
            pos = ctx.position_call if ctx.position_call.pos else dataclasses.replace(
                ctx.position_call, pos=pos)
        dq, dk, dv, dparams, dpos_q, dpos_k = positional_backward(
            prior, use_triton, dout, q, k, v, out, saved, theta.detach(), causal, scale, layout,
            pos, ctx.position_grads)
        dtheta = make_dtheta(prior.traits, theta, dparams) if ctx.needs_input_grad[4] else None
        return (None, dq, dk, dv, dtheta,
                dpos_q.to(pos_q.dtype) if ctx.needs_input_grad[5] else None,
                dpos_k.to(pos_k.dtype) if ctx.needs_input_grad[6] else None, None, None, None, None,
                None)


@outside_autocast
def positional_backward(prior, use_triton, dout, q, k, v, out, saved, theta, causal, scale,
                        layout, pos, position_grads):
    """(dq, dk, dv, dparams, dpos_q, dpos_k) of one positional forward, from what it saved."""
    if use_triton:
        from .triton import launch
        return launch.backward(prior, dout, q, k, v, out, *saved, theta, causal, scale,
                               layout.q_offset, layout.k_offset, pos=pos,
                               position_grads=position_grads, **layout.masks())
    return cpu_backward.backward(prior, dout, q, k, v, out, *saved, theta, causal, scale,
                                 layout.q_offset, layout.k_offset, pos=pos,
                                 position_grads=position_grads, **layout.masks())
