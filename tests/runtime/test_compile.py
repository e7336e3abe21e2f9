"""torch.compile, torch.export and torch.func over the generated modules (docs/architecture.md, "Custom ops").

Under tracing, attention() and the module call the custom ops torch.ops.bamgen.<name>_<hash>_fwd
and _bwd; these tests hold a compiled or exported model to its eager run: the same output and the
same gradients for q, k, v and the prior parameters, one graph for every sequence length, no graph
break. Compiling is slow (tens of seconds for the first inductor compile): one inductor test, the
others through the "aot_eager" backend, which traces the same graphs (dynamo and AOT autograd,
the fake implementations, register_autograd) without generating code.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

from bamgen.generated import bam_ssmax, fire, gaussian, generalized_gaussian as ggd, t5, uniform
from bamgen.generated import forget_gate as fg
from bamgen.runtime.ops import TritonOps, op_name
from tests.helpers import ROOT

LENGTHS = (17, 40, 65)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class TinyDecoder(torch.nn.Module):
    """A user's attention layer: projections, GQA heads, the generated module, an output map."""

    def __init__(self, d_model=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d_model // heads
        self.q = torch.nn.Linear(d_model, d_model)
        self.kv = torch.nn.Linear(d_model, 2 * kv_heads * self.head_dim)
        self.o = torch.nn.Linear(d_model, d_model)
        self.attn = ggd.GeneralizedGaussianAttention(heads)

    def forward(self, x):
        B, N, _ = x.shape
        q = self.q(x).view(B, N, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(B, N, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = self.attn(q, k, v, causal=True)
        return self.o(out.transpose(1, 2).reshape(B, N, -1))


def run_step(model, fn, x):
    """Output and every gradient of one step (x's and all the model's parameters')."""
    model.zero_grad()
    x = x.detach().requires_grad_()
    out = fn(x)
    out.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return out.detach(), x.grad.clone(), grads


def assert_same_step(got, want):
    """The attention op runs the same code compiled or not; inductor's code for the layers
    around it (a bias gradient's sum, the fused exp of the raw parameters) may add in another
    order, so the step is held to float32's default closeness, not to the bit."""
    out, dx, grads = got
    torch.testing.assert_close(out, want[0])
    torch.testing.assert_close(dx, want[1])
    assert grads.keys() == want[2].keys()
    for name in grads:
        torch.testing.assert_close(grads[name], want[2][name], msg=name)


def graph_breaks():
    return sum(counters["graph_break"].values())


def test_decoder_compiles_once_for_every_length():
    """Inductor, fullgraph, dynamic: three lengths, one graph, gradients (raw prior parameters
    included) equal to eager."""
    torch.manual_seed(0)
    model = TinyDecoder()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for n in LENGTHS:
        x = torch.randn(2, n, 32)
        assert_same_step(run_step(model, compiled, x), run_step(model, model, x))
    assert counters["stats"]["unique_graphs"] == 1
    assert graph_breaks() == 0
    assert any(p.grad.abs().sum() > 0 for name, p in model.named_parameters() if "raw_" in name)


def test_automatic_dynamic_recompiles_once():
    """Without dynamic=True, torch compiles the first length static and the second dynamic;
    a third length must reuse the dynamic graph."""
    torch.manual_seed(1)
    model = TinyDecoder()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for n in LENGTHS:
        run_step(model, compiled, torch.randn(2, n, 32))
    assert counters["stats"]["unique_graphs"] == 2
    assert graph_breaks() == 0


@pytest.mark.parametrize("causal", [True, False])
def test_attention_function_compiles(causal):
    """The functional form with a tensor parameter (gradient), floats and int offsets, GQA."""
    torch.manual_seed(2)
    sigma = torch.tensor([3.0, 5.0, 8.0, 13.0], requires_grad=True)

    def f(q, k, v):
        return gaussian.attention(q, k, v, sigma=sigma, mu=1.0, causal=causal, q_offset=4, k_offset=0)

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for n in LENGTHS:
        q = torch.randn(1, 4, n, 8, requires_grad=True)
        k, v = (torch.randn(1, 2, n + 4, 8, requires_grad=True) for _ in range(2))
        results = []
        for fn in (compiled, f):
            out = fn(q, k, v)
            results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v, sigma))))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 1
    assert graph_breaks() == 0


@pytest.mark.parametrize("module", [t5, fire], ids=["t5", "fire"])
def test_vector_parameters_compile(module):
    """Vector parameters (T5's [H, 32] table; FIRE's shared [32] layer, shared scalars and
    per-head [H, 32] layer) go into the op as tensors: one graph for every length, the same
    output and gradients of every element as eager."""
    torch.manual_seed(4)
    params = {n: t.clone().requires_grad_() for n, t in module.default_params(4).items()}
    if module is fire:   # (shared scalars as a user passes them: 0-d)
        params["c"], params["L"] = (torch.tensor(v, requires_grad=True) for v in (0.3, 6.5))

    def f(q, k, v):
        return module.attention(q, k, v, **params, causal=True)

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for n in LENGTHS:
        q, k, v = (torch.randn(1, 4, n, 8, requires_grad=True) for _ in range(3))
        results = []
        for fn in (compiled, f):
            out = fn(q, k, v)
            results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v, *params.values()))))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 1
    assert graph_breaks() == 0


def test_masks_compile():
    """key_mask, per-row tensor offsets and packed documents go into the op as tensors: checked
    and used at run time, no graph break."""
    torch.manual_seed(3)
    params = dict(alpha=4.0, beta=1.5, mu=0.0)
    q, k, v = (torch.randn(2, 2, 12, 8, requires_grad=True) for _ in range(3))
    key_mask = torch.rand(2, 12) > 0.3
    cases = [dict(key_mask=key_mask, q_offset=torch.tensor([-2, 0]), k_offset=torch.tensor([-2, 0]))]
    packed = [t[:1].detach().requires_grad_() for t in (q, k, v)]
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)

    def f(q, k, v, **masks):
        return ggd.attention(q, k, v, **params, **masks)

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for tensors, masks in ((q, k, v), cases[0]), (packed, dict(cu_seqlens_q=cu, cu_seqlens_k=cu)):
        want = f(*tensors, **masks)
        got = compiled(*tensors, **masks)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        for g, w in zip(torch.autograd.grad(got.sum(), tensors), torch.autograd.grad(want.sum(), tensors)):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert graph_breaks() == 0


def test_errors_under_compile_are_eager_errors():
    """Checks that read values run inside the op: the same ValueError as in eager."""
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))

    def bad_domain(q, k, v):
        return ggd.attention(q, k, v, alpha=torch.tensor([2.0, -1.0]), beta=2.0, mu=0.0)

    def bad_docs(q, k, v):
        cu = torch.tensor([0, 4, 3, 6], dtype=torch.int32)
        return ggd.attention(q, k, v, alpha=2.0, beta=2.0, mu=0.0, cu_seqlens_q=cu, cu_seqlens_k=cu)

    for fn in (bad_domain, bad_docs):
        with pytest.raises(ValueError) as eager:
            fn(q, k, v)
        with pytest.raises(ValueError) as traced:
            torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
        assert str(traced.value) == str(eager.value)


def test_export_round_trip():
    """torch.export with a dynamic length; the exported program runs a new length like eager."""
    torch.manual_seed(4)
    model = TinyDecoder().eval()
    n = torch.export.Dim("n", min=2, max=1024)
    program = torch.export.export(model, (torch.randn(2, 16, 32),), dynamic_shapes=({1: n},))
    assert any(OP in str(node.target) for node in program.graph.nodes for OP in [ggd.OP_NAME])
    x = torch.randn(2, 37, 32)
    torch.testing.assert_close(program.module()(x), model(x), rtol=0, atol=0)


def test_func_grad_and_vmap():
    """torch.func.grad of a function of q equals autograd; vmap over an extra batch dim equals a
    loop, and so do per-sample gradients (vmap of grad)."""
    torch.manual_seed(5)
    k, v = (torch.randn(1, 2, 9, 8) for _ in range(2))

    def loss(q):
        return gaussian.attention(q, k, v, sigma=4.0, mu=0.0).square().sum()

    qs = torch.randn(3, 1, 2, 9, 8)
    want = torch.stack([torch.autograd.grad(loss(q.requires_grad_()), q)[0] for q in qs.clone()])
    torch.testing.assert_close(torch.func.grad(loss)(qs[0]), want[0], rtol=0, atol=0)
    with pytest.warns(UserWarning, match="batching rule"):   # torch's per-element fallback
        per_sample = torch.func.vmap(torch.func.grad(loss))(qs)
    torch.testing.assert_close(per_sample, want, rtol=0, atol=0)


def test_func_grad_and_vmap_with_positions():
    """torch.func.grad and vmap(grad) of a FoX call (positions as tensors) equal autograd, the
    positions' gradients included; the positional ops' own autograd refused the transforms
    ('it must override the setup_context staticmethod')."""
    torch.manual_seed(8)
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))

    def loss(c, q):
        return fg.attention(q, k, v, causal=True, pos_q=c, pos_k=c).square().sum()

    cs = torch.randn(3, 1, 2, 9).cumsum(-1)
    want = []
    for c in cs:
        c = c.clone().requires_grad_()
        loss(c, q).backward()
        want.append(c.grad)
    want = torch.stack(want)
    torch.testing.assert_close(torch.func.grad(loss)(cs[0], q), want[0], rtol=0, atol=0)
    with pytest.warns(UserWarning, match="batching rule"):   # torch's per-element fallback
        per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(0, None))(cs, q)
    torch.testing.assert_close(per_sample, want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="has no second derivative"):
        torch.func.grad(lambda c: torch.func.grad(loss)(c, q).sum())(cs[0])


SECOND = "has no second derivative"


@pytest.mark.parametrize("backend", ["torch", "triton"], ids=["cpu_path", "kernels"])
def test_second_derivatives_raise_instead_of_a_silent_zero(backend):
    """A gradient taken with create_graph=True cannot be differentiated through the attention:
    a gradient penalty, a Hessian, torch.func.grad of a grad, and a prior over position tensors
    raise, where the gradients came back as constants (the penalty's share of dk dropped, a
    Hessian of zeros: silent)."""
    torch.manual_seed(6)
    layer = ggd.GeneralizedGaussianAttention(2)
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))

    def loss(x):
        return layer(x, k, v, backend=backend).square().sum()

    x = q.clone().requires_grad_()
    k.requires_grad_()
    out = layer(x, k, v, backend=backend)
    g, = torch.autograd.grad(out.sum(), x, create_graph=True)   # a gradient penalty on x
    with pytest.raises(RuntimeError, match=SECOND):
        (out.sum() + g.square().sum()).backward()
    with pytest.raises(RuntimeError, match=SECOND):
        torch.autograd.functional.hessian(loss, q)
    with pytest.raises(RuntimeError, match=SECOND):
        torch.func.grad(lambda y: torch.func.grad(loss)(y).sum())(q)
    c = torch.randn(1, 2, 5).cumsum(-1).requires_grad_()
    out = fg.attention(q, k, v, causal=True, pos_q=c, pos_k=c, backend=backend)
    g, = torch.autograd.grad(out.sum(), c, create_graph=True)
    with pytest.raises(RuntimeError, match=SECOND):
        torch.autograd.grad(g.sum(), k)
    # first derivatives with create_graph=True are the ordinary ones
    x = q.clone().requires_grad_()
    g, = torch.autograd.grad(loss(x), x, create_graph=True)
    x2 = q.clone().requires_grad_()
    torch.testing.assert_close(g, torch.autograd.grad(loss(x2), x2)[0], rtol=0, atol=0)
    g.mul_(0.5)   # (the gradients are the caller's to change in place, as before)


def test_op_names_and_reimport(monkeypatch):
    """The ops are torch.ops.bamgen.<prior>_<op hash>_fwd / _bwd (docs/architecture.md, "Custom
    ops"); importing the same build again under another module name shares the first import's
    op objects (registering again left the first import calling a dangling operator handle), and
    both imports still compile. (A different build: tests/runtime/test_export_names.py.)"""
    assert gaussian.OP_NAME == op_name(gaussian.PRIOR) and gaussian.OP_NAME.startswith("gaussian_")
    assert ggd.OP_NAME.startswith("generalized_gaussian_") and ggd.OP_NAME != gaussian.OP_NAME
    assert hasattr(torch.ops.bamgen, gaussian.OP_NAME + "_fwd")
    assert hasattr(torch.ops.bamgen, gaussian.OP_NAME + "_bwd")
    # the prior's own name too, for the first build imported: the same ops
    assert torch.ops.bamgen.gaussian_fwd is getattr(torch.ops.bamgen, gaussian.OP_NAME + "_fwd")
    assert torch.ops.bamgen.generalized_gaussian_bwd is getattr(torch.ops.bamgen, ggd.OP_NAME + "_bwd")
    spec = importlib.util.spec_from_file_location("gaussian_again", gaussian.__file__)
    again = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gaussian_again", again)
    spec.loader.exec_module(again)
    assert again._prior.ops is gaussian._prior.ops
    assert again._prior.triton_ops is gaussian._prior.triton_ops
    q, k, v = (torch.randn(1, 2, 7, 8) for _ in range(3))
    for module in (gaussian, again):
        fn = torch.compile(lambda q, k, v: module.attention(q, k, v, sigma=3.0, mu=0.0),
                           fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(fn(q, k, v), gaussian.attention(q, k, v, sigma=3.0, mu=0.0),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("module, params", [
    (gaussian, dict(sigma=[2.0, 3.0], mu=[0.5, -1.0])),
    (ggd, dict(alpha=[2.0, 3.0], beta=[1.5, 2.5], mu=[0.5, -0.5])),
])
def test_gradcheck_float64(module, params):
    """float64 on the torch path: torch.autograd.gradcheck for q, k, v and every learnable
    parameter (mu off the integer distances, away from the kink)."""
    torch.manual_seed(6)
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    names = list(params)
    values = [torch.tensor(params[n], dtype=torch.float64, requires_grad=n in module.LEARNABLE)
              for n in names]

    def f(q, k, v, *values):
        return module.attention(q, k, v, **dict(zip(names, values)), causal=False)

    assert torch.autograd.gradcheck(f, (q, k, v, *values))


# ----------------------------------------------------------------------------------------
# The GPU path under torch.compile: the triton ops (prepare, fwd_triton, bwd_triton). Here the
# kernels run interpreted inside an "aot_eager" graph; with BAMGEN_TEST_DEVICE=cuda (make
# gpu-check) the same tests compile with inductor on the GPU.
# ----------------------------------------------------------------------------------------
GPU = os.environ.get("BAMGEN_TEST_DEVICE", "cpu") == "cuda"
DEVICE = "cuda" if GPU else "cpu"


def traced_ops(seen):
    """A torch.compile backend: "aot_eager" (inductor on a GPU) that records the bamgen ops of
    the forward and backward graphs AOT autograd made."""
    from torch._dynamo.backends.common import aot_autograd
    from functorch.compile import make_boxed_func

    def record(gm, _inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if "bamgen" in str(n.target))
        return make_boxed_func(gm.forward)

    if GPU:
        return "inductor"
    return aot_autograd(fw_compiler=record, bw_compiler=record)


def assert_same(got, want):
    """Bit for bit under the interpreter (the same kernels, the same tiles); on a GPU inductor
    compiles the kernels itself, held to torch's default closeness for the dtype (a contraction
    mismatch between forward and backward moved a sharp prior's dV by 0.6 on an H100)."""
    if GPU:
        torch.testing.assert_close(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_path_compiles_through_triton_ops(dtype):
    """backend="triton" under fullgraph, dynamic compile: three lengths, a key_mask on one, one
    graph per layout, no graph break; out and the gradients of q, k, v and a learnable parameter
    equal eager, with a sharp prior (alpha down to 0.5 and mu = 30: logits ~1e3 apart, where
    the backward's rebuilt P is most sensitive to how each logit was rounded); the graphs hold
    the triton ops, not the opaque _fwd / _bwd, and on a GPU inductor's code launches the
    kernels."""
    torch.manual_seed(7)
    alpha = torch.tensor([0.5, 1.0, 2.0, 4.0], device=DEVICE, requires_grad=True)

    def f(q, k, v, key_mask):
        return ggd.attention(q, k, v, alpha=alpha, beta=2.0, mu=30.0, key_mask=key_mask,
                             backend="triton")

    def step(fn, q, k, v, key_mask):
        out = fn(q, k, v, key_mask)
        return (out, *torch.autograd.grad(out.float().square().sum(), (q, k, v, alpha)))

    assert ggd._prior.triton_ops is not None, "the triton ops need TRITON_DEFAULT_FP_FUSION=0 on a GPU"
    seen = set()
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend=traced_ops(seen))
    for n, masked in zip(LENGTHS, (False, True, False)):
        q = torch.randn(1, 4, n, 8, device=DEVICE, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, 2, n, 8, device=DEVICE, dtype=dtype, requires_grad=True)
                for _ in range(2))
        key_mask = torch.rand(1, n, device=DEVICE) > 0.3 if masked else None
        if GPU and n == LENGTHS[0]:
            from torch._inductor.utils import run_and_get_code
            got, code = run_and_get_code(step, compiled, q, k, v, key_mask)
            assert all(name in "\n".join(code) for name in ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq"))
        else:
            got = step(compiled, q, k, v, key_mask)
        for g, w in zip(got, step(f, q, k, v, key_mask)):
            assert_same(g, w)
    assert counters["stats"]["unique_graphs"] == 2   # (with and without a key_mask)
    assert graph_breaks() == 0
    if not GPU:
        assert seen == {f"bamgen.{ggd.OP_NAME}_{op}.default" for op in ("prepare", "fwd_triton",
                                                                        "bwd_triton")}


@pytest.mark.parametrize("module", [bam_ssmax, uniform], ids=["bam_ssmax", "uniform"])
def test_triton_decode_steps_compile_once(module):
    """A generation loop compiled once: one new row against a cache that grows (the split-KV
    decode kernels, no gradient), the same rows as eager, no recompile as the cache grows.
    BAM-SSMax reads n (the key counts from the prepare op); NoPE has no table."""
    torch.manual_seed(8)
    params = module.default_params(4)
    params = {name: value.to(DEVICE) for name, value in params.items()}

    def step(q, k, v):
        return module.attention(q, k, v, **params, q_offset=k.shape[2] - 1, backend="triton")

    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=traced_ops(set()))
    k, v = (torch.randn(1, 2, 70, 16, device=DEVICE) for _ in range(2))
    with torch.no_grad():
        for n in (33, 50, 69):   # (slices of one cache: a view of its whole would be contiguous, a guard)
            q = torch.randn(1, 4, 1, 16, device=DEVICE)
            assert_same(compiled(q, k[:, :, :n], v[:, :, :n]), step(q, k[:, :, :n], v[:, :, :n]))
    assert counters["stats"]["unique_graphs"] == 1
    assert graph_breaks() == 0


@pytest.mark.skipif(GPU, reason="the interpreter's kernels: on a GPU they are JITFunctions")
def test_interpreted_kernels_launch_as_they_are_under_torch_2_11(monkeypatch):
    """torch 2.11's wrap_triton takes only a JITFunction or an Autotuner, and refuses the
    interpreter's kernels (torch 2.13 hands them back): under TRITON_INTERPRET=1 the triton ops
    are opaque custom ops, so their kernels launch as they are, with either torch."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction
    real = torch.library.wrap_triton

    def as_torch_2_11(kernel):
        if not isinstance(kernel, (JITFunction, Autotuner)):
            raise RuntimeError("wrap_triton only works on functions annotated with triton.jit "
                               "or triton.autotune")
        return real(kernel)

    monkeypatch.setattr(torch.library, "wrap_triton", as_torch_2_11)
    params = uniform.default_params(4)
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 21, 16), torch.randn(1, 2, 21, 16)

    def step(q, k, v):
        return uniform.attention(q, k, v, **params, q_offset=20, backend="triton")

    with torch.no_grad():
        got = torch.compile(step, fullgraph=True, dynamic=True, backend=traced_ops(set()))(q, k, v)
    assert_same(got, step(q, k, v))


def test_triton_errors_under_compile_are_eager_errors():
    """The prepare op checks what eager checks, when it runs: the same ValueError."""
    q, k, v = (torch.randn(1, 2, 6, 8, device=DEVICE) for _ in range(3))

    def bad_domain(q, k, v):
        return ggd.attention(q, k, v, alpha=torch.tensor([2.0, -1.0], device=DEVICE), beta=2.0,
                             mu=0.0, backend="triton")

    def bad_mask(q, k, v):
        return ggd.attention(q, k, v, alpha=2.0, beta=2.0, mu=0.0, backend="triton",
                             key_mask=torch.ones(1, 6, device=DEVICE))

    for fn in (bad_domain, bad_mask):
        with pytest.raises(ValueError) as eager:
            fn(q, k, v)
        with pytest.raises(ValueError) as traced:
            torch.compile(fn, fullgraph=True, backend=traced_ops(set()))(q, k, v)
        assert str(traced.value) == str(eager.value)


@pytest.mark.parametrize("fusion, wanted", [(None, False), ("1", False), ("0", True), ("false", True)])
def test_triton_ops_only_where_contraction_is_off(monkeypatch, fusion, wanted):
    """On a CUDA machine the triton ops are registered only with TRITON_DEFAULT_FP_FUSION off:
    inductor drops the launches' enable_fp_fusion=False, and the exact backward needs it."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if fusion is None:
        monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    else:
        monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", fusion)
    assert TritonOps.wanted() is wanted


TRACE_SCRIPT = r"""
import importlib.util, json, pathlib, sys, tempfile, types
sys.path.insert(0, sys.argv[1])
import torch
import triton
from torch._functorch.aot_autograd import aot_export_module
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code
from bamgen.generated import generalized_gaussian as ggd
from bamgen.runtime.ops import TritonOps
from bamgen.runtime.triton import launch

# What a machine with an H100 would do, without one: register the ops as a CUDA import does,
# and answer the two device queries the host code makes.
ggd._prior.triton_ops = ops = TritonOps(ggd._prior)
launch.gpu_family = lambda device=None: "sm_90"
torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
    multi_processor_count=132, major=9, minor=0, name="NVIDIA H100 80GB HBM3")


class Step(torch.nn.Module):
    # a training step's forward and backward, and a decode step, on a symbolic length
    def forward(self, q, k, v, q1, theta):
        table, window, counts = ops.prepare(q, k, theta, True, 0, 0, None, True, True)
        out, stats, o32 = ops.fwd(q, k, v, theta, table, window, counts, None, True, 0.125, 0, 0, True)
        grads = ops.bwd(out, q, k, v, o32, stats, theta, table, window, counts, None, True, 0.125, 0, 0)
        n = k.shape[2]
        t1, w1, c1 = ops.prepare(q1, k, theta, True, n - 1, 0, None, False, True)
        return (out, *grads, ops.fwd(q1, k, v, theta, t1, w1, c1, None, True, 0.125, n - 1, 0, False)[0])


mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)


def fake(shape, dtype=torch.bfloat16, dynamic=(2,)):
    # meta tensors: a CPU build of torch has no CUDA device, and the traced graph is the same
    sizes = [DimDynamic.DYNAMIC if d in dynamic else DimDynamic.STATIC for d in range(len(shape))]
    return mode.from_tensor(torch.empty(shape, device="meta", dtype=dtype),
                            symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))


args = (fake((2, 4, 300, 64)), fake((2, 2, 300, 64)), fake((2, 2, 300, 64)),
        fake((2, 4, 1, 64), dynamic=()), fake((4, 3), torch.float32, dynamic=()))
with mode:
    graph, _ = aot_export_module(Step(), args, trace_joint=False)
launches = []
for node in graph.graph.nodes:
    if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
        kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        while not hasattr(kernel, "arg_names") or hasattr(kernel.fn, "fn"):
            kernel = kernel.fn   # (num_warps wraps a kernel in a one-config autotuner)
        # the source inductor emits for the kernel: every function it names, the prior's hooks
        # included, re-read from the globals, and it defines them all (docs/architecture.md,
        # "Hooks": why the kernels find the hooks by name)
        source = user_defined_triton_kernel_transitive_closure_source_code(kernel)
        emitted = pathlib.Path(tempfile.mkdtemp()) / "emitted.py"   # (Triton reads it back)
        emitted.write_text("import triton\nimport triton.language as tl\n" + source)
        spec = importlib.util.spec_from_file_location(f"emitted_{len(launches)}", emitted)
        namespace = vars(importlib.util.module_from_spec(spec))
        spec.loader.exec_module(sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec)))
        namespace = vars(sys.modules[spec.name])
        launches.append({"kernel": kernel.fn.__name__,
                         "symbolic_grid": not isinstance(node.kwargs["grid"][0][0], int),
                         "d_top_b": str(node.kwargs["kwargs"].get("d_top_b")),
                         "defines": sorted(name for name, value in namespace.items()
                                           if isinstance(value, triton.runtime.jit.JITFunction))})
        if kernel.fn.__name__ == "_attn_bwd_dq":   # the emitted dQ kernel compiles to the same code
            from bamgen.aot import compile_module
            emitted_specs = ggd._prior.triton_kernel_specs
            emitted_dq = triton.jit(namespace["_attn_bwd_dq"])   # (inductor adds the decorator)
            def with_emitted(*args, **kwargs):
                return [(n, emitted_dq, *rest) if n == "attn_bwd_dq" else (n, fn, *rest)
                        for n, fn, *rest in emitted_specs(*args, **kwargs)]
            registers = []
            for specs in (emitted_specs, with_emitted):
                ggd.triton_kernel_specs = specs
                (k,) = compile_module(ggd, arch="sm_90", head_dim=64, only=("attn_bwd_dq",))
                registers.append((k.registers, k.sass["total"]))
            launches[-1]["emitted_compiles_alike"] = registers[0] == registers[1]
print(json.dumps(launches))
"""


def test_triton_ops_trace_to_kernel_launches():
    """Without the interpreter, the triton ops decompose under AOT autograd into one
    triton_kernel_wrapper_functional per launch (what inductor compiles): every kernel of a
    training step and a decode step, their grids and d_top_b symbolic in the length."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", TRACE_SCRIPT, str(ROOT)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    launches = json.loads(res.stdout.strip().splitlines()[-1])
    assert [launch["kernel"] for launch in launches] == [
        "_attn_fwd", "_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq", "_attn_decode",
        "_decode_combine"]
    dq = next(launch for launch in launches if launch["kernel"] == "_attn_bwd_dq")
    assert {"prior_scalars", "prior_grads", "_table_logit2", "_grad_sums"} <= set(dq["defines"])
    assert dq["emitted_compiles_alike"]
    for launch in launches:
        if launch["kernel"] != "_decode_combine":   # (one program per query row: 1)
            assert launch["symbolic_grid"], launch
        if launch["kernel"] not in ("_bwd_preprocess", "_decode_combine"):
            assert not launch["d_top_b"].isdigit(), launch   # a SymInt: no recompile per length
