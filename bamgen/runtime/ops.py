"""Custom ops: what torch.compile, torch.export and torch.func see (docs/architecture.md, "Custom
ops").

Each prior's forward and backward are torch.library custom ops in the namespace bamgen, named
after the prior and the hash of what they run (op_name: two builds of one prior in a process do
not collide, and a saved program finds the build it was traced with; importing the same build
again shares the first import's ops: shared_ops). Their fake implementations give
the output shapes without running anything, so a trace has no graph break and a new sequence
length is one more value of a symbolic size, not a recompile. Everything that reads tensor
values (the parameters' domains, tensor offsets, cu_seqlens, key counts, the CPU path's
threads) runs inside the ops, at run time. Eager calls keep the autograd Function (the same
kernels, less dispatch), except in a selective activation checkpoint's region, where a policy
names the forward op (checkpointing).

Triton ops: the GPU path under torch.compile, in the open. A traced GPU call with int offsets
and no packed documents runs three ops instead of the opaque _fwd: _prepare (a custom op: the
checks that read values, the prior's table, window and key counts, all host work that reads
tensors) and _fwd_triton / _bwd_triton (torch.library.triton_ops: their host code reads no
tensor value, so torch.compile traces through them and inductor sees every kernel launch, the
launches wrapped by torch.library.wrap_triton). Their own backward (register_autograd on
_fwd_triton) takes the forward's table. Per-row tensor offsets and packed documents, whose
table size and work lists depend on values, stay in the opaque _fwd / _bwd; so does torch.func.
The ops are registered where they can run exactly: under TRITON_INTERPRET=1, or with CUDA and
TRITON_DEFAULT_FP_FUSION=0 (TritonOps.wanted says why).

(No `from __future__ import annotations` here: torch.library reads the ops' annotations.)
"""
import functools
import hashlib
import math
from typing import Optional, Tuple

import torch

from . import autograd, checks
from .constants import TABLE_PAD
from .host_reads import read_fresh
from .params import dtheta
from .positions import check_traced_bounds
from .tables import acc_dtype
from .triton import interpreting


# The version of the ops' arguments (their names, types, defaults and meaning): part of every
# op's name, so a program saved by a bamgen whose ops took other arguments fails to load instead
# of running with them dropped or defaulted (torch.export.load drops an argument the op no longer
# takes, without a word). Bump it with any change to them; tests/runtime/test_export_names.py
# records the schemas of each version.
OPS_SCHEMA = 1


def op_name(meta) -> str:
    """The ops' name, torch.ops.bamgen.<op_name>_fwd / _bwd (docs/architecture.md, "Custom
    ops"): the prior's name and 8 hex of the hash of what the ops run (compiler/codegen.py:
    op_hash) with OPS_SCHEMA. A function of the build alone, not of what else the process
    imported: a program saved by torch.export or AOTInductor names the build it was traced
    with, a fresh process that loads that build resolves it, and one that loaded an edited
    prior of the same name (another formula, parameters or strategy) has no op of that name,
    so loading fails instead of running the other formula (docs/packaging.md, "torch.export
    and AOTInductor"). A module built before the op hash existed is named by its build hash."""
    runs = meta.get("op_hash", meta["build_hash"])
    return f"{meta['name']}_{hashlib.sha256(f'{runs}:{OPS_SCHEMA}'.encode()).hexdigest()[:8]}"


def claimed_op_name(meta) -> str:
    """op_name(meta), unless another copy of the runtime already registered ops of that name in
    this process: a standalone build's runtime, frozen at its build (docs/packaging.md), beside
    the installed one, with the same math printed. Its kernels may differ (a fix since), so
    each copy runs its own: the second takes that name with its runtime's own tag."""
    name = op_name(meta)
    owner = torch.library.__dict__.setdefault("_bamgen_op_owners", {}).setdefault(name, __name__)
    if owner == __name__:
        return name
    return f"{name}_{hashlib.sha256(__name__.encode()).hexdigest()[:8]}"


def shared_ops(prior, kind, make):
    """The ops of this name, registered by the first import in the process of a build with them:
    a second import (another module name, `generated.x` beside `bamgen.generated.x`, a reload,
    a build that differs only outside the ops: its description, its parameters' initial
    values, the bamgen version) shares them, the same math by the name's construction.
    Registering a name again would replace the first import's registration under the op
    objects it still calls: a dangling operator handle in C++ (crashes seen: a segmentation
    fault and a std::bad_alloc in a fake-tensor call, with two imports in one process)."""
    registry = torch.library.__dict__.setdefault("_bamgen_ops", {})
    key = (prior.op_name, kind)
    if key not in registry:
        registry[key] = make(prior)
        _alias_prior_name(prior)
    return registry[key]


# every op a prior may register, after its name (Ops and TritonOps)
OP_SUFFIXES = ("_fwd", "_bwd", "_pfwd", "_pbwd", "_prepare", "_fwd_triton", "_bwd_triton")


def _alias_prior_name(prior) -> None:
    """torch.ops.bamgen.<the prior's name>_fwd, _bwd, ... as well, the names docs/architecture.md
    promises for the first build of a prior a process imports: the same op objects as
    <op_name>_fwd, ..., so a call through either is one op, and a traced graph (a saved
    program) names the hashed ops, which find their build. A later build of another math keeps
    its hashed names alone, as an edited prior took <name>_<build hash> before."""
    owners = torch.library.__dict__.setdefault("_bamgen_alias_owners", {})
    if owners.setdefault(prior.meta["name"], prior.op_name) != prior.op_name:
        return
    namespace = torch.ops.bamgen
    for suffix in OP_SUFFIXES:
        if torch._C._dispatch_has_kernel(f"bamgen::{prior.op_name}{suffix}"):
            setattr(namespace, prior.meta["name"] + suffix, getattr(namespace, prior.op_name + suffix))


# torch < 2.12 has no such query; its non-strict export traces FakeTensors, which tracing() sees
_non_strict_tracing = getattr(torch.compiler, "_is_non_strict_tracing", lambda: False)


def tracing(q) -> bool:
    """Whether this call is being traced (torch.compile, torch.export, make_fx) or runs under a
    torch.func transform: then attention() calls the custom ops."""
    return (torch.compiler.is_compiling() or _non_strict_tracing()
            or torch._C._functorch.peek_interpreter_stack() is not None
            or isinstance(q, torch._subclasses.FakeTensor)
            or (isinstance(q, torch.Tensor) and q.is_meta))


def _checkpoint_modes() -> tuple:
    """The dispatch modes of a selective activation checkpoint (torch.utils.checkpoint: the
    one that caches the forward's ops, the one that hands them back to the recomputation);
    private names, so none where a torch has no such classes."""
    import torch.utils.checkpoint as checkpoint
    return tuple(getattr(checkpoint, name) for name in
                 ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode") if hasattr(checkpoint, name))


def checkpointing() -> bool:
    """Whether this call runs in the region of a selective activation checkpoint
    (torch.utils.checkpoint.create_selective_checkpoint_contexts, as torchtitan uses it): an
    eager call then runs the custom ops too, so the policy sees bamgen's attention forward as
    one op it can name (docs/architecture.md, "Selective activation checkpointing"), not the
    autograd Function's inner kernels and torch ops, which a policy could not name, and which
    a policy that saves every op could not cache (the torch path writes into tensors it made:
    a cached one came back mutated). Any other dispatch mode (a FlopCounterMode, a count of
    the ops a call dispatches) still sees those inner ops. ~0.1 us without a mode."""
    if torch._C._len_torch_dispatch_stack() == 0:
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    modes = _checkpoint_modes()
    return any(isinstance(mode, modes) for mode in _get_current_dispatch_mode_stack())


def through_ops(q) -> bool:
    """Whether attention() and the module's forward call the custom ops: traced (tracing) or
    under a selective activation checkpoint (checkpointing); else the autograd Functions, with
    less dispatch (an eager training step of 1 x 4 x 32 x 32 x 32 on the CPU took 6.3 ms by
    the Function, 7.3 ms by the op; a decode step 0.37 ms and 0.71 ms)."""
    return tracing(q) or checkpointing()   # (tracing first: dynamo cannot trace the mode stack)


def attend(prior, q, k, v, theta, causal, scale, backend, q_offset, k_offset, key_mask,
           cu_seqlens_q, cu_seqlens_k, check):
    """attention() through the custom ops: offsets split into an int and an optional tensor, the
    masks passed as they came; checks.layout() checks them inside the op."""
    B = q.shape[0]
    offsets = []
    for name, value in (("q_offset", q_offset), ("k_offset", k_offset)):
        if isinstance(value, torch.Tensor):
            offsets += [0, value]
        else:
            offsets += [checks.offset(name, value, B, q.device)[0], None]
    for name, value in (("key_mask", key_mask), ("cu_seqlens_q", cu_seqlens_q),
                        ("cu_seqlens_k", cu_seqlens_k)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a tensor or None, got {value!r}")
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    use_triton = autograd.use_triton(q, backend)
    for_backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, theta))
    args = (q, k, v, theta, causal, scale, offsets[0], offsets[2], offsets[1], offsets[3], key_mask,
            cu_seqlens_q, cu_seqlens_k, use_triton, for_backward, check)
    if torch._C._functorch.peek_interpreter_stack() is not None and not torch.compiler.is_compiling():
        return FuncAttention.apply(prior, *args)[0]   # torch.func.grad, vmap, jacrev
    # (an eager call under a selective checkpoint takes the opaque _fwd: one op to name)
    if (use_triton and prior.triton_ops is not None and offsets[1] is None and offsets[3] is None
            and cu_seqlens_q is None and cu_seqlens_k is None and q.numel() != 0 and k.shape[2] != 0
            and tracing(q)):
        return _attend_triton_op(prior, q, k, v, theta, causal, scale, offsets[0], offsets[2],
                                 key_mask, for_backward, check)
    return prior.ops.fwd(*args)[0]


# ----------------------------------------------------------------------------------------
# The opaque ops: _fwd and _bwd, either backend inside
# ----------------------------------------------------------------------------------------
def _op_layout(q, k, q_offset, k_offset, q_offsets, k_offsets, key_mask, cu_seqlens_q, cu_seqlens_k):
    """Inside an op: the layout arguments checked and normalised by checks.layout() (its
    errors)."""
    return checks.layout(q, k, q_offset if q_offsets is None else q_offsets,
                         k_offset if k_offsets is None else k_offsets, key_mask, cu_seqlens_q,
                         cu_seqlens_k)


@read_fresh   # (a compiled graph runs it: host_reads)
def _op_fwd(prior, q, k, v, theta, causal, scale, q_offset, k_offset, q_offsets, k_offsets, key_mask,
            cu_seqlens_q, cu_seqlens_k, use_triton, for_backward, check):
    """(out, stats, extra): out contiguous in q's dtype; stats the softmax statistics of the
    backend ([B, Hq, Nq, 2] in the compute dtype on the torch path, float32 [2, B, Hq, Nq] on
    Triton); extra the float32 O of a low-precision Triton forward that a backward will follow,
    else an empty tensor. check: refuse parameters outside their domains (attention())."""
    checks.check_causal(prior.traits, causal)   # (a traced call's: attention() checks eager ones)
    checks.check_theta(prior.traits, theta)
    layout = _op_layout(q, k, q_offset, k_offset, q_offsets, k_offsets, key_mask, cu_seqlens_q,
                        cu_seqlens_k)
    if check:
        prior.domain_check(theta)
    if q.numel() == 0 or k.shape[2] == 0:   # no query, or no key: every row is 0
        return tuple(t.zero_() for t in _op_fwd_fake(q, k, v, theta, causal, scale, q_offset, k_offset,
                                                     q_offsets, k_offsets, key_mask, cu_seqlens_q,
                                                     cu_seqlens_k, use_triton, for_backward, check))
    out, stats, *rest = autograd.forward(prior, q, k, v, theta, causal, scale, layout, use_triton,
                                         for_backward)
    if use_triton:   # rest: out32 (out itself unless a backward follows a low-precision input), table
        extra = rest[0] if rest[0] is not out else q.new_empty((0,), dtype=torch.float32)
    else:
        extra = q.new_empty((0,))
    return out.contiguous(), stats.contiguous(), extra   # (the strides the fake gives)


def _op_fwd_fake(q, k, v, theta, causal, scale, q_offset, k_offset, q_offsets, k_offsets, key_mask,
                 cu_seqlens_q, cu_seqlens_k, use_triton, for_backward, check):
    """The forward op's outputs, allocated and not computed (its fake implementation)."""
    B, Hq, Nq, D = q.shape
    out = q.new_empty((B, Hq, Nq, D))
    if use_triton:
        stats = q.new_empty((2, B, Hq, Nq), dtype=torch.float32)
        o32 = for_backward and q.dtype != torch.float32
        return out, stats, q.new_empty((B, Hq, Nq, D) if o32 else (0,), dtype=torch.float32)
    return out, q.new_empty((B, Hq, Nq, 2), dtype=acc_dtype(q)), q.new_empty((0,))


@read_fresh   # (a compiled graph runs it: host_reads)
def _op_bwd(prior, dout, q, k, v, out, stats, extra, theta, causal, scale, q_offset, k_offset,
            q_offsets, k_offsets, key_mask, cu_seqlens_q, cu_seqlens_k, use_triton):
    """(dq, dk, dv, dparams [Hq, learnable] in theta's dtype) of one _op_fwd."""
    layout = _op_layout(q, k, q_offset, k_offset, q_offsets, k_offsets, key_mask, cu_seqlens_q,
                        cu_seqlens_k)
    if q.numel() == 0 or k.shape[2] == 0:
        return tuple(g.zero_() for g in _op_bwd_fake(prior, dout, q, k, v, out, stats, extra, theta))
    saved = (stats, extra if extra.numel() else out, None) if use_triton else (stats,)
    dq, dk, dv, dparams = autograd.backward(prior, use_triton, dout, q, k, v, out, saved, theta,
                                            causal, scale, layout)
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dparams.to(theta.dtype).contiguous()


def _op_bwd_fake(prior, dout, q, k, v, out, stats, extra, theta, *_settings):
    """The backward op's outputs, allocated and not computed (its fake implementation)."""
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            theta.new_empty((theta.shape[0], prior.traits.num_grads)))


def _op_setup_context(ctx, inputs, output):
    q, k, v, theta, causal, scale, q_offset, k_offset, *masks = inputs[:13]
    use_triton = inputs[13]
    out, stats, extra = output
    ctx.save_for_backward(q, k, v, theta, out, stats, extra, *masks)
    ctx.settings = (causal, scale, q_offset, k_offset, use_triton)


def _op_backward(prior, ctx, dout, _dstats, _dextra):
    q, k, v, theta, out, stats, extra, *masks = ctx.saved_tensors
    causal, scale, q_offset, k_offset, use_triton = ctx.settings
    dq, dk, dv, dparams = prior.ops.bwd(dout, q, k, v, out, stats, extra, theta, causal, scale,
                                        q_offset, k_offset, *masks, use_triton)
    return (dq, dk, dv, dtheta(prior.traits, theta, dparams)) + (None,) * 12


# ----------------------------------------------------------------------------------------
# Positions as tensors (docs/positions.md): _pfwd and _pbwd, either backend inside
# ----------------------------------------------------------------------------------------
def attend_positional(prior, q, k, v, theta, pos_q, pos_k, causal, scale, backend, key_mask,
                      cu_seqlens_q, cu_seqlens_k, check, q_offset=0, k_offset=0, bounds=(None, None)):
    """attention() with position tensors ([B, Hq, N, C], checked and shaped by
    positions.positions_of) through the positional custom ops; bounds: positions.traced_bounds
    of the tensors the user gave, which the op checks as eager attention() does."""
    for name, value in (("key_mask", key_mask), ("cu_seqlens_q", cu_seqlens_q),
                        ("cu_seqlens_k", cu_seqlens_k)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a tensor or None, got {value!r}")
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    use_triton = autograd.use_triton(q, backend)
    for_backward = torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k, v, theta, pos_q, pos_k))
    # (no position gradient wanted: integer positions may read a table prior's distance table)
    position_grads = for_backward and (pos_q.requires_grad or pos_k.requires_grad)
    args = (q, k, v, theta, pos_q, pos_k, causal, scale, key_mask, cu_seqlens_q, cu_seqlens_k,
            use_triton, for_backward, check, position_grads, q_offset, k_offset, *bounds)
    if torch._C._functorch.peek_interpreter_stack() is not None and not torch.compiler.is_compiling():
        return FuncPositionalAttention.apply(prior, *args)[0]   # torch.func.grad, vmap, jacrev
    return prior.ops.pfwd(*args)[0]


@read_fresh   # (a compiled graph runs it: host_reads)
def _op_pfwd(prior, q, k, v, theta, pos_q, pos_k, causal, scale, key_mask, cu_seqlens_q,
             cu_seqlens_k, use_triton, for_backward, check, position_grads, q_offset=0, k_offset=0,
             q_bounds=None, k_bounds=None):
    """(out, stats, extra) as _op_fwd's, of a call with position tensors (the int offsets
    place its tokens for the causal mask); q_bounds, k_bounds: positions.traced_bounds."""
    checks.check_causal(prior.traits, causal, pos_q, pos_k)
    checks.check_theta(prior.traits, theta)
    extent = check_traced_bounds(q_bounds, k_bounds)
    layout = checks.layout(q, k, q_offset, k_offset, key_mask, cu_seqlens_q, cu_seqlens_k)
    if check:
        prior.domain_check(theta)
    if q.numel() == 0 or k.shape[2] == 0:
        return tuple(t.zero_() for t in _op_pfwd_fake(q, k, v, theta, pos_q, pos_k, causal, scale,
                                                      key_mask, cu_seqlens_q, cu_seqlens_k,
                                                      use_triton, for_backward, check,
                                                      position_grads, q_offset, k_offset))
    out, stats, *rest = autograd.positional_forward(prior, q, k, v, theta, (pos_q, pos_k), causal,
                                                    scale, layout, use_triton, for_backward,
                                                    position_grads, extent)
    extra = q.new_empty((0,), dtype=torch.float32)
    if use_triton and rest[0] is not out:
        extra = rest[0]
    return out.contiguous(), stats.contiguous(), extra


def _op_pfwd_fake(q, k, v, theta, pos_q, pos_k, causal, scale, key_mask, cu_seqlens_q, cu_seqlens_k,
                  use_triton, for_backward, check, position_grads, q_offset=0, k_offset=0,
                  q_bounds=None, k_bounds=None):
    return _op_fwd_fake(q, k, v, theta, causal, scale, q_offset, k_offset, None, None, key_mask,
                        cu_seqlens_q, cu_seqlens_k, use_triton, for_backward, check)


@read_fresh   # (a compiled graph runs it: host_reads)
def _op_pbwd(prior, dout, q, k, v, out, stats, extra, theta, pos_q, pos_k, causal, scale, key_mask,
             cu_seqlens_q, cu_seqlens_k, use_triton, position_grads, q_offset=0, k_offset=0):
    """(dq, dk, dv, dparams, dpos_q, dpos_k) of one _op_pfwd."""
    if q.numel() == 0 or k.shape[2] == 0:
        return tuple(g.zero_() for g in _op_pbwd_fake(prior, dout, q, k, v, out, stats, extra,
                                                      theta, pos_q, pos_k))
    layout = checks.layout(q, k, q_offset, k_offset, key_mask, cu_seqlens_q, cu_seqlens_k)
    saved = (stats, extra if extra.numel() else out, None) if use_triton else (stats,)
    dq, dk, dv, dparams, dpos_q, dpos_k = autograd.positional_backward(
        prior, use_triton, dout, q, k, v, out, saved, theta, causal, scale, layout, (pos_q, pos_k),
        position_grads)
    return (dq.contiguous(), dk.contiguous(), dv.contiguous(), dparams.to(theta.dtype).contiguous(),
            dpos_q.to(pos_q.dtype).contiguous(), dpos_k.to(pos_k.dtype).contiguous())


def _op_pbwd_fake(prior, dout, q, k, v, out, stats, extra, theta, pos_q, pos_k, *_settings):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            theta.new_empty((theta.shape[0], prior.traits.num_grads)),
            pos_q.new_empty(pos_q.shape), pos_k.new_empty(pos_k.shape))


def _op_p_setup_context(ctx, inputs, output):
    q, k, v, theta, pos_q, pos_k, causal, scale, *masks = inputs[:11]
    use_triton, position_grads, q_offset, k_offset = inputs[11], inputs[14], inputs[15], inputs[16]
    out, stats, extra = output
    ctx.save_for_backward(q, k, v, theta, pos_q, pos_k, out, stats, extra, *masks)
    ctx.settings = (causal, scale, use_triton, position_grads, q_offset, k_offset)


def _op_p_backward(prior, ctx, dout, _dstats, _dextra):
    q, k, v, theta, pos_q, pos_k, out, stats, extra, *masks = ctx.saved_tensors
    causal, scale, use_triton, position_grads, q_offset, k_offset = ctx.settings
    dq, dk, dv, dparams, dpos_q, dpos_k = prior.ops.pbwd(dout, q, k, v, out, stats, extra, theta,
                                                         pos_q, pos_k, causal, scale, *masks,
                                                         use_triton, position_grads, q_offset,
                                                         k_offset)
    return (dq, dk, dv, dtheta(prior.traits, theta, dparams), dpos_q, dpos_k) + (None,) * 13


def _func_attention(name: str, doc: str, op: str, setup_context, backward) -> type:
    """An autograd Function around a prior's custom ops under torch.func transforms (grad,
    vmap, jacrev), which the ops' own register_autograd does not support: forward runs the op
    named ``op`` of prior.ops, setup_context and backward are the ops' own, and vmap runs them
    once per vmapped element (torch's fallback loop, generate_vmap_rule). Second derivatives
    raise (autograd.first_order)."""
    def forward(prior, *args):
        with torch.no_grad():   # (the op's own autograd would refuse the transform)
            return getattr(prior.ops, op)(*args)

    def setup(ctx, inputs, output):
        ctx.prior = inputs[0]
        setup_context(ctx, inputs[1:], output)
        ctx.mark_non_differentiable(output[1], output[2])

    @autograd.first_order
    def run_backward(ctx, dout, _dstats, _dextra):
        return (None,) + backward(ctx.prior, ctx, dout, _dstats, _dextra)

    return type(name, (torch.autograd.Function,), {
        "__doc__": doc, "__module__": __name__, "generate_vmap_rule": True,
        "forward": staticmethod(forward), "setup_context": staticmethod(setup),
        "backward": staticmethod(run_backward)})


FuncAttention = _func_attention(
    "FuncAttention", "The ops _fwd and _bwd under torch.func transforms.", "fwd",
    _op_setup_context, _op_backward)
FuncPositionalAttention = _func_attention(
    "FuncPositionalAttention", "The positional ops _pfwd and _pbwd under torch.func transforms, "
    "gradients for the positions included.", "pfwd", _op_p_setup_context, _op_p_backward)


class Ops:
    """A prior's two custom ops, registered on import of its module."""

    def __init__(self, prior):
        lib = "bamgen::" + prior.op_name

        def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, theta: torch.Tensor, causal: bool,
                scale: float, q_offset: int, k_offset: int, q_offsets: Optional[torch.Tensor],
                k_offsets: Optional[torch.Tensor], key_mask: Optional[torch.Tensor],
                cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
                use_triton: bool, for_backward: bool, check: bool
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return _op_fwd(prior, q, k, v, theta, causal, scale, q_offset, k_offset, q_offsets,
                           k_offsets, key_mask, cu_seqlens_q, cu_seqlens_k, use_triton,
                           for_backward, check)

        def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor, stats: torch.Tensor, extra: torch.Tensor, theta: torch.Tensor,
                causal: bool, scale: float, q_offset: int, k_offset: int,
                q_offsets: Optional[torch.Tensor], k_offsets: Optional[torch.Tensor],
                key_mask: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
                cu_seqlens_k: Optional[torch.Tensor], use_triton: bool
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            return _op_bwd(prior, dout, q, k, v, out, stats, extra, theta, causal, scale, q_offset,
                           k_offset, q_offsets, k_offsets, key_mask, cu_seqlens_q, cu_seqlens_k,
                           use_triton)

        self.fwd = torch.library.custom_op(lib + "_fwd", fwd, mutates_args=())
        self.fwd.register_fake(_op_fwd_fake)
        self.bwd = torch.library.custom_op(lib + "_bwd", bwd, mutates_args=())
        self.bwd.register_fake(functools.partial(_op_bwd_fake, prior))
        self.fwd.register_autograd(functools.partial(_op_backward, prior),
                                   setup_context=_op_setup_context)

        def pfwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, theta: torch.Tensor,
                 pos_q: torch.Tensor, pos_k: torch.Tensor, causal: bool, scale: float,
                 key_mask: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
                 cu_seqlens_k: Optional[torch.Tensor], use_triton: bool, for_backward: bool,
                 check: bool, position_grads: bool, q_offset: int, k_offset: int,
                 q_bounds: Optional[torch.Tensor] = None, k_bounds: Optional[torch.Tensor] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return _op_pfwd(prior, q, k, v, theta, pos_q, pos_k, causal, scale, key_mask,
                            cu_seqlens_q, cu_seqlens_k, use_triton, for_backward, check,
                            position_grads, q_offset, k_offset, q_bounds, k_bounds)

        def pbwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, stats: torch.Tensor, extra: torch.Tensor, theta: torch.Tensor,
                 pos_q: torch.Tensor, pos_k: torch.Tensor, causal: bool, scale: float,
                 key_mask: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
                 cu_seqlens_k: Optional[torch.Tensor], use_triton: bool, position_grads: bool,
                 q_offset: int, k_offset: int
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor]:
            return _op_pbwd(prior, dout, q, k, v, out, stats, extra, theta, pos_q, pos_k, causal,
                            scale, key_mask, cu_seqlens_q, cu_seqlens_k, use_triton,
                            position_grads, q_offset, k_offset)

        # positions as tensors (docs/positions.md): <name>_pfwd / _pbwd
        self.pfwd = torch.library.custom_op(lib + "_pfwd", pfwd, mutates_args=())
        self.pfwd.register_fake(_op_pfwd_fake)
        self.pbwd = torch.library.custom_op(lib + "_pbwd", pbwd, mutates_args=())
        self.pbwd.register_fake(functools.partial(_op_pbwd_fake, prior))
        self.pfwd.register_autograd(functools.partial(_op_p_backward, prior),
                                    setup_context=_op_p_setup_context)


# ----------------------------------------------------------------------------------------
# The triton ops (see the module's docstring)
# ----------------------------------------------------------------------------------------
@read_fresh   # (a compiled graph runs it: host_reads)
def _op_prepare(prior, q, k, theta, causal, q_offset, k_offset, key_mask, for_backward, check):
    """(table, window, counts) of a traced GPU call, after the eager checks: the distance table
    (with its derivative slots when a backward follows; [1] for an inline prior), the block
    skipping window ([1, 2] without skipping) and the key counts n ([B, Nq] with key_mask for a
    prior that reads n, else [1, Nq]; a prior that does not read n gets memory for the rows the
    kernels' loads address, never filled). Every output is new memory."""
    from .triton import launch
    checks.check_causal(prior.traits, causal)
    checks.check_theta(prior.traits, theta)
    layout = _op_layout(q, k, q_offset, k_offset, None, None, key_mask, None, None)
    if check:
        prior.domain_check(theta)
    table, _, window, counts = launch.prior_inputs(prior, q, k, theta, q_offset, k_offset, causal,
                                                   for_backward, True, key_mask=layout.key_mask)
    counts_shape = _op_counts_shape(prior, q.shape[0], q.shape[2], key_mask)
    if window is table:   # (no block skipping: a placeholder, never read)
        window = torch.zeros(1, 2, dtype=torch.int32, device=q.device)
    if table is theta:    # (the inline strategy: likewise)
        table = theta.new_zeros(1)
    return table, window, counts[:counts_shape[0], :counts_shape[1]].contiguous()


def _op_counts_shape(prior, B, Nq, key_mask):
    """The shape _op_prepare gives the key counts (expanded to [B, Nq] where they are read)."""
    return (B, Nq) if prior.traits.uses_n and key_mask is not None else (1, Nq)


def _op_prepare_fake(prior, q, k, theta, causal, q_offset, k_offset, key_mask, for_backward, check):
    B, Hq, Nq, _ = q.shape
    Nk = k.shape[2]
    if prior.traits.table:
        slots = 1 + len(prior.traits.table_grads) * bool(for_backward)
        table = theta.new_empty((Hq, slots, Nq + Nk - 1 + 2 * TABLE_PAD))   # (tables.prior_tables)
    else:
        table = theta.new_empty((1,))
    if prior.traits.skip is not None:
        window = q.new_empty((Hq, 2), dtype=torch.int32)
    else:
        window = q.new_empty((1, 2), dtype=torch.int32)
    return table, window, q.new_empty(_op_counts_shape(prior, B, Nq, key_mask), dtype=torch.float32)


def _op_kernel_inputs(q, counts, q_offset, k_offset, key_mask):
    """What a triton op hands the kernels besides its tensors: the layout, d_top (the call's
    largest distance plus TABLE_PAD, from shapes and int offsets) and the counts as [B, Nq]."""
    from .triton import launch
    B, _, Nq, _ = q.shape
    lay = launch.KernelLayout(q, q_offset, k_offset, key_mask, None, None)
    d_top = q_offset - k_offset + Nq - 1 + TABLE_PAD
    return lay, d_top, counts.expand(B, Nq)


def _fwd_triton_launches(prior, wrap, q, k, v, theta, table, window, counts, key_mask, causal, scale,
                         q_offset, k_offset, for_backward):
    from .triton import launch
    lay, d_top, counts = _op_kernel_inputs(q, counts, q_offset, k_offset, key_mask)
    out, stats, out32 = launch.forward_kernels(prior, q, k, v, theta, causal, scale, table, d_top,
                                               window, counts, lay, for_backward, True, wrap)
    return out, stats, (out32 if out32 is not out else q.new_empty((0,), dtype=torch.float32))


def _bwd_triton_launches(prior, wrap, dout, q, k, v, out32, stats, theta, table, window, counts,
                         key_mask, causal, scale, q_offset, k_offset):
    from .triton import launch
    lay, d_top, counts = _op_kernel_inputs(q, counts, q_offset, k_offset, key_mask)
    dq, dk, dv, dparams = launch.backward_kernels(prior, dout, q, k, v, out32, stats, theta, causal,
                                                  scale, table, d_top, window, counts, lay, False,
                                                  True, wrap)
    return dq, dk, dv, dparams.contiguous()


def _traced_kernel(kernel):
    """launch.traced_kernel (Triton imported on the first launch, not when the ops register)."""
    from .triton import launch
    return launch.traced_kernel(kernel)


def _skipped_kernel(kernel):
    """launch.skipped_kernel (likewise)."""
    from .triton import launch
    return launch.skipped_kernel(kernel)


def _op_triton_setup_context(ctx, inputs, output):
    q, k, v, theta, table, window, counts, key_mask, causal, scale, q_offset, k_offset, _ = inputs
    out, stats, extra = output
    ctx.save_for_backward(q, k, v, theta, table, window, counts, out, stats, extra,
                          *([] if key_mask is None else [key_mask]))
    ctx.settings = (causal, scale, q_offset, k_offset)


def _op_triton_backward(prior, ctx, dout, _dstats, _dextra):
    q, k, v, theta, table, window, counts, out, stats, extra, *mask = ctx.saved_tensors
    causal, scale, q_offset, k_offset = ctx.settings
    out32 = out if q.dtype == torch.float32 else extra
    dq, dk, dv, dparams = prior.triton_ops.bwd(dout, q, k, v, out32, stats, theta, table, window,
                                               counts, mask[0] if mask else None, causal, scale,
                                               q_offset, k_offset)
    return (dq, dk, dv, dtheta(prior.traits, theta, dparams)) + (None,) * 9


def _attend_triton_op(prior, q, k, v, theta, causal, scale, q_offset, k_offset, key_mask,
                      for_backward, check):
    """attention() on the GPU under tracing, through the triton ops (int offsets, no packed
    documents). key_mask goes to _prepare as given (checked there) and to the kernels as bool."""
    ops = prior.triton_ops
    table, window, counts = ops.prepare(q.detach(), k.detach(), theta.detach(), causal, q_offset,
                                        k_offset, key_mask, for_backward, check)
    if key_mask is not None:
        key_mask = key_mask.to(device=q.device, dtype=torch.bool)
    return ops.fwd(q, k, v, theta, table, window, counts, key_mask, causal, scale, q_offset,
                   k_offset, for_backward)[0]


class TritonOps:
    """A prior's triton ops, registered on import where the GPU path can run. Under
    TRITON_INTERPRET=1, whose kernels torch cannot trace, _fwd_triton and _bwd_triton are
    opaque custom ops instead, their fake implementation the same host code with the launches
    skipped: a compiled graph then runs what a GPU's would, its kernels interpreted."""

    def __init__(self, prior):
        lib = "bamgen::" + prior.op_name

        def prepare(q: torch.Tensor, k: torch.Tensor, theta: torch.Tensor, causal: bool,
                    q_offset: int, k_offset: int, key_mask: Optional[torch.Tensor],
                    for_backward: bool, check: bool
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return _op_prepare(prior, q, k, theta, causal, q_offset, k_offset, key_mask,
                               for_backward, check)

        def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, theta: torch.Tensor,
                table: torch.Tensor, window: torch.Tensor, counts: torch.Tensor,
                key_mask: Optional[torch.Tensor], causal: bool, scale: float, q_offset: int,
                k_offset: int, for_backward: bool
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """(out, stats, extra) of the Triton forward, as the _fwd op returns them; on a GPU
            also its own fake implementation (torch.library.triton_op)."""
            return _fwd_triton_launches(prior, _traced_kernel, q, k, v, theta, table, window,
                                        counts, key_mask, causal, scale, q_offset, k_offset,
                                        for_backward)

        def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out32: torch.Tensor, stats: torch.Tensor, theta: torch.Tensor, table: torch.Tensor,
                window: torch.Tensor, counts: torch.Tensor, key_mask: Optional[torch.Tensor],
                causal: bool, scale: float, q_offset: int, k_offset: int
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            """(dq, dk, dv, dparams [Hq, learnable]) of one fwd (out32: O in float32)."""
            return _bwd_triton_launches(prior, _traced_kernel, dout, q, k, v, out32, stats,
                                        theta, table, window, counts, key_mask, causal, scale,
                                        q_offset, k_offset)

        self.prepare = torch.library.custom_op(lib + "_prepare", prepare, mutates_args=())
        self.prepare.register_fake(functools.partial(_op_prepare_fake, prior))
        if interpreting():
            self.fwd = torch.library.custom_op(lib + "_fwd_triton", fwd, mutates_args=())
            self.fwd.register_fake(functools.partial(_fwd_triton_launches, prior,
                                                     _skipped_kernel))
            self.bwd = torch.library.custom_op(lib + "_bwd_triton", bwd, mutates_args=())
            self.bwd.register_fake(functools.partial(_bwd_triton_launches, prior,
                                                     _skipped_kernel))
        else:
            self.fwd = torch.library.triton_op(lib + "_fwd_triton", fwd, mutates_args=())
            self.bwd = torch.library.triton_op(lib + "_bwd_triton", bwd, mutates_args=())
        self.fwd.register_autograd(functools.partial(_op_triton_backward, prior),
                                   setup_context=_op_triton_setup_context)

    @staticmethod
    def wanted():
        """Triton installed, and the interpreter, or CUDA with Triton's FP contraction off by
        default (TRITON_DEFAULT_FP_FUSION=0 when the module is imported; importing Triton costs
        ~0.3 s: a CPU user without CUDA never pays it).

        Why the environment: the backward rebuilds P from the forward's row statistics, exact
        only if every kernel rounds each logit alike, so every launch passes
        enable_fp_fusion=FP_FUSION (see launch.FP_FUSION). Inductor compiles a traced kernel
        launch with Triton's default options and drops that argument; with the default
        contraction on, a sharp prior's dV was off by up to 0.6 on an H100. Without the
        variable, traced GPU calls keep the opaque ops, which launch the kernels as eager does."""
        import importlib.util
        import os
        if importlib.util.find_spec("triton") is None:
            return False
        fusion = os.environ.get("TRITON_DEFAULT_FP_FUSION", "1").strip().lower()
        return interpreting() or (torch.cuda.is_available() and fusion in ("0", "false", "off"))
