"""Selective activation checkpointing in eager mode (docs/architecture.md, "Selective activation
checkpointing"): a torch.utils.checkpoint policy names bamgen's attention forward,
torch.ops.bamgen.<OP_NAME>_fwd (or _pfwd with position tensors), as torchtitan's policies name
SDPA's. Saving it runs the attention forward once per step, recomputing it runs it twice; the
output and every gradient are those of the step without checkpointing, bit for bit."""
import functools

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from bamgen.generated import gaussian
from bamgen.runtime import autograd

FWD = getattr(torch.ops.bamgen, gaussian.OP_NAME + "_fwd").default
PFWD = getattr(torch.ops.bamgen, gaussian.OP_NAME + "_pfwd").default


@pytest.fixture
def forwards(monkeypatch):
    """How many times the attention forward ran (either backend's, with or without positions)."""
    runs = {"n": 0}
    for name in ("forward", "positional_forward"):
        original = getattr(autograd, name)

        def counted(*args, _original=original, **kwargs):
            runs["n"] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(autograd, name, counted)
    return runs


def policy(saved_ops, others=CheckpointPolicy.PREFER_RECOMPUTE):
    """A selective checkpoint policy: save the ops in saved_ops, `others` for every other op."""
    def decide(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved_ops else others
    return decide


def inputs(positions, fn=None):
    """q, k, v, sigma (None for the module, which has its own) and pos (or None)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 12, 16, requires_grad=True) for _ in range(3))
    sigma = None if isinstance(fn, Module) else torch.tensor([2.0, 5.0], requires_grad=True)
    pos = torch.cumsum(torch.rand(2, 12) + 0.5, 1).requires_grad_() if positions else None
    return q, k, v, sigma, pos


def step(fn, tensors, backend, context_fn=None):
    """(output, gradients of every input and parameter) of one step, checkpointed when
    context_fn is given."""
    leaves = [t for t in tensors if t is not None] + list(getattr(fn, "parameters", list)())
    for t in leaves:
        t.grad = None

    def layer(q, k, v, sigma, pos):
        return fn(q, k, v, sigma, pos, backend).sin()
    out = layer(*tensors) if context_fn is None else checkpoint(layer, *tensors, use_reentrant=False,
                                                                context_fn=context_fn)
    out.square().sum().backward()
    return out.detach(), [t.grad for t in leaves]


def functional(q, k, v, sigma, pos, backend):
    return gaussian.attention(q, k, v, sigma=sigma, mu=0.5, backend=backend, pos_q=pos, pos_k=pos)


class Module(gaussian.GaussianAttention):
    """The nn.Module, with its own parameters (sigma is None)."""

    def __call__(self, q, k, v, sigma, pos, backend):
        return super().__call__(q, k, v, backend=backend, pos_q=pos, pos_k=pos)


CASES = [pytest.param(functional, "torch", False, id="torch"),
         pytest.param(functional, "triton", False, id="triton"),
         pytest.param(functional, "torch", True, id="positions"),
         pytest.param(Module(2), "torch", False, id="module")]


def assert_same_step(got, want):
    assert torch.equal(got[0], want[0])
    assert len(got[1]) == len(want[1])
    for g, w in zip(got[1], want[1]):
        assert g is not None and torch.equal(g, w)


@pytest.mark.parametrize("fn, backend, positions", CASES)
@pytest.mark.parametrize("save, runs", [(True, 1), (False, 2)], ids=["save", "recompute"])
def test_a_policy_names_the_attention_forward(forwards, fn, backend, positions, save, runs):
    tensors = inputs(positions, fn)
    plain = step(fn, tensors, backend)
    forwards["n"] = 0
    saved = {PFWD if positions else FWD} if save else set()
    checkpointed = step(fn, tensors, backend, functools.partial(
        create_selective_checkpoint_contexts, policy(saved)))
    assert forwards["n"] == runs
    assert_same_step(checkpointed, plain)


def test_a_policy_that_saves_every_op(forwards):
    """Every op saved (a policy's simplest form): the attention's own inner ops, which write
    into tensors they made, are not in the region's cache (they came back 'mutated')."""
    tensors = inputs(False)
    plain = step(functional, tensors, "torch")
    forwards["n"] = 0
    everything = policy(set(), others=CheckpointPolicy.MUST_SAVE)
    checkpointed = step(functional, tensors, "torch", functools.partial(
        create_selective_checkpoint_contexts, everything))
    assert forwards["n"] == 1
    assert_same_step(checkpointed, plain)


def test_the_prior_name_answers_for_the_op():
    """docs/architecture.md: the first build of a prior a process imports answers to its own
    name, the name a policy can write without the hash."""
    assert torch.ops.bamgen.gaussian_fwd.default is FWD


def test_a_second_derivative_under_a_selective_checkpoint_is_refused():
    """In a selective checkpoint's region the call runs the custom ops, whose backward op has
    no derivative of its own: differentiating a gradient raises (torch's error naming the op;
    a plain checkpoint of the autograd Function raises torch's CheckpointError), never a
    silent zero."""
    q, k, v, sigma, _ = inputs(False)
    out = checkpoint(functional, q, k, v, sigma, None, "torch", use_reentrant=False,
                     context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                  policy({FWD})))
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=gaussian.OP_NAME + "_bwd"):
        dq.sum().backward()


def test_other_dispatch_modes_still_see_the_torch_path():
    """A FlopCounterMode is no checkpoint: the call keeps the autograd Function, whose torch
    path's matmuls it counts (the custom op has no flop formula: it would count 0)."""
    from torch.utils.flop_counter import FlopCounterMode
    q, k, v, sigma, _ = inputs(False)
    with FlopCounterMode(display=False) as flops:
        functional(q, k, v, sigma, None, "torch").sum().backward()
    assert flops.get_total_flops() > 0
