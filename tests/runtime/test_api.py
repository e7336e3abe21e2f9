"""The generated module's contract (docs/architecture.md, "The generated module"): argument checks, parameters, edge rows."""
import sys

import pytest
import torch

from generated import generalized_gaussian as ggd
from generated import laplace, t5, uniform


def qkv(B=1, Hq=4, Hk=2, Nq=9, Nk=11, D=16, dtype=torch.float32):
    return (torch.randn(B, Hq, Nq, D, dtype=dtype), torch.randn(B, Hk, Nk, D, dtype=dtype),
            torch.randn(B, Hk, Nk, D, dtype=dtype))


P = dict(alpha=2.0, beta=1.0, mu=0.0)


@pytest.mark.parametrize("change, argument", [
    (lambda q, k, v: (q[0], k, v), "q"),
    (lambda q, k, v: (q, k.half(), v), "dtype"),
    (lambda q, k, v: (q.long(), k.long(), v.long()), "dtype"),
    (lambda q, k, v: (q, k[:, :, :5], v), "k and v"),
    (lambda q, k, v: (q, torch.randn(2, 2, 11, 16), torch.randn(2, 2, 11, 16)), "batch"),
    (lambda q, k, v: (q, k[..., :8], v[..., :8]), "head dim"),
    (lambda q, k, v: (q, torch.randn(1, 3, 11, 16), torch.randn(1, 3, 11, 16)), "multiple"),
])
def test_bad_tensors_raise_value_error_naming_the_argument(change, argument):
    q, k, v = change(*qkv())
    with pytest.raises(ValueError, match=argument):
        ggd.attention(q, k, v, **P)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(alpha=torch.ones(3)), "alpha"),
    (dict(alpha=torch.ones(4, device="meta")), "alpha is on the meta device"),
    (dict(beta=torch.ones(2, 2)), "beta"),
    (dict(mu="zero"), "mu"),
    (dict(q_offset=1.5), "q_offset"),
    (dict(k_offset=True), "k_offset"),
    (dict(causal="yes"), "causal"),
    (dict(scale=-1.0), "scale"),
    (dict(backend="cuda"), "backend"),
])
def test_bad_arguments_raise_value_error_naming_the_argument(kwargs, argument):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=argument):
        ggd.attention(q, k, v, **{**P, **kwargs})


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_numpy_integer_offsets_are_taken_as_ints(backend):
    """A chunk's offset read from a NumPy array (np.int64, np.int32) is an int to the user: the
    functional form, the module and the block API take it as they take 6."""
    import numpy as np
    q, k, v = qkv(Nq=5, Nk=11)
    want = ggd.attention(q, k, v, **P, q_offset=6, backend=backend)
    for offset in (np.int64(6), np.int32(6), np.array([6])[0]):
        got = ggd.attention(q, k, v, **P, q_offset=offset, k_offset=np.int64(0), backend=backend)
        assert torch.equal(got, want)
    module = ggd.GeneralizedGaussianAttention(num_heads=4)
    assert torch.equal(module(q, k, v, q_offset=np.int64(6), backend=backend),
                       module(q, k, v, q_offset=6, backend=backend))
    blocks = [ggd.forward_block(q, k, v, **P, q_offset=off, backend=backend)[0]
              for off in (np.int64(6), 6)]
    assert torch.equal(*blocks)
    with pytest.raises(ValueError, match="q_offset must be an int"):
        ggd.attention(q, k, v, **P, q_offset=np.float64(6.0), backend=backend)


def test_triton_backend_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton'"):
        ggd.attention(*qkv(), **P, backend="triton")


def test_default_params_follow_the_spec_inits():
    values = ggd.default_params(8)
    assert torch.allclose(values["alpha"], torch.tensor([2.0 ** (h + 1) for h in range(8)]))
    assert torch.equal(values["beta"], torch.ones(8)) and torch.equal(values["mu"], torch.zeros(8))
    b = laplace.default_params(4)["b"]   # 1 / ALiBi slopes 2^(-8(h+1)/H)
    assert torch.allclose(1 / b, torch.tensor([2 ** (-8 * (h + 1) / 4) for h in range(4)]))


def test_the_base_module_class_says_to_use_a_prior_s_own():
    """A user who reaches for the base class every generated module exposes gets told what to
    construct instead, not an AttributeError from inside it."""
    with pytest.raises(TypeError, match=r"base class .*\.GeneralizedGaussianAttention\(num_heads=8\)"):
        ggd.PriorAttention(num_heads=8)
    assert ggd.GeneralizedGaussianAttention(num_heads=2).num_heads == 2


def test_a_module_built_on_the_meta_device_loads_its_weights():
    """`with torch.device("meta")` builds a large model without memory, then
    load_state_dict(assign=True) brings the weights: the prior's parameters are meta tensors
    (their init was made on meta and its domain check read a meta value: an internal
    'Tensor.item() cannot be called on meta tensors'), and the loaded module attends as the
    saved one."""
    torch.manual_seed(0)
    saved = ggd.GeneralizedGaussianAttention(num_heads=2, init={"beta": 1.5})
    with torch.device("meta"):
        layer = ggd.GeneralizedGaussianAttention(num_heads=2, init={"beta": 1.5})
        with pytest.raises(ValueError, match="alpha must be positive"):
            ggd.GeneralizedGaussianAttention(num_heads=2, init={"alpha": -1.0})
    assert {p.device.type for p in layer.parameters()} == {"meta"}
    layer.load_state_dict(saved.state_dict(), assign=True)
    q = torch.randn(1, 2, 6, 8)
    torch.testing.assert_close(layer(q, q, q), saved(q, q, q), rtol=0, atol=0)


@pytest.mark.parametrize("make, words", [
    (lambda: ggd.GeneralizedGaussianAttention(num_heads=3, init={"alpha": torch.ones(4)}),
     "init: alpha must be a float or a tensor of shape [3] (one value per query head), got shape (4,)"),
    (lambda: laplace.LaplaceAttention(3, init={"b": "two"}),
     "init: b must be a float or a tensor of shape [3], got str"),
    (lambda: t5.T5Attention(num_heads=2, init={"w": torch.zeros(31)}),
     "init: w must be a tensor of shape [2, 32] (a row per query head) or [32], got shape (31,)"),
    (lambda: laplace.LaplaceAttention(3, init={"b": -1.0}),
     "init: b must be positive (> 0) and finite"),
])
def test_a_wrong_init_is_named_as_the_module_s_init_argument(make, words):
    """A value of the constructor's init= that attention() would refuse is refused as init=,
    not as a keyword of attention()."""
    with pytest.raises(ValueError) as err:
        make()
    assert str(err.value).startswith(words), str(err.value)


def test_reset_parameters_after_to_empty_initialises_as_the_constructor():
    """A module built on the meta device and materialised with to_empty() (FSDP's deferred
    initialisation) had no way back to its init but a state dict: reset_parameters() gives
    the constructor's values, init= included, in place; a random init (T5's buckets) is drawn
    anew, as nn.Linear's is."""
    from generated import t5
    want = ggd.GeneralizedGaussianAttention(num_heads=4, init={"beta": 1.5})
    with torch.device("meta"):
        layer = ggd.GeneralizedGaussianAttention(num_heads=4, init={"beta": 1.5})
    layer.to_empty(device="cpu")
    raw_alpha = layer.raw_alpha
    layer.reset_parameters()
    assert layer.raw_alpha is raw_alpha   # (in place: an optimiser's references stay valid)
    for name, value in want.state_dict().items():
        assert torch.equal(layer.state_dict()[name], value), name
    torch.manual_seed(0)
    buckets = t5.T5Attention(num_heads=2)
    before = buckets.raw_w.clone()
    buckets.reset_parameters()
    assert buckets.raw_w.shape == before.shape and not torch.equal(buckets.raw_w, before)
    assert 0.01 < float(buckets.raw_w.std()) < 0.1   # its init: normal(0, 0.044)


def test_meta_tensors_give_shapes_forward_and_backward():
    """A forward on meta tensors (shape inference: a pipeline stage's, a model built on the
    meta device) gives the output's shape and the gradients' shapes through the custom ops'
    fake implementations, as under torch.compile (it stopped inside the CPU path with
    'Tensor.item() cannot be called on meta tensors')."""
    with torch.device("meta"):
        layer = ggd.GeneralizedGaussianAttention(num_heads=4)
        q, k, v = qkv(B=2, Hq=4, Hk=2)
    q.requires_grad_()
    out = layer(q, k, v)
    assert out.is_meta and out.shape == q.shape
    out.sum().backward()
    assert q.grad.is_meta and q.grad.shape == q.shape
    assert layer.raw_alpha.grad.is_meta and layer.raw_alpha.grad.shape == (4,)
    with torch.no_grad():
        assert layer(q[:, :, :1], k, v, q_offset=10).shape == (2, 4, 1, 16)   # a decode step


def test_torch_jit_trace_is_refused_with_what_to_use_instead():
    """torch.jit.trace of a model with the module or attention() says it is not supported and
    names torch.export (an AttributeError, 'Tensor' object has no attribute 'bit_length', came
    from inside the CPU decode step, whose sizes the trace turns into tensors)."""
    layer = ggd.GeneralizedGaussianAttention(num_heads=2)
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(RuntimeError, match="torch.jit.trace is not supported.*torch.export"):
        torch.jit.trace(layer, (q, q, q))
    with pytest.raises(RuntimeError, match="torch.jit.trace is not supported"):
        torch.jit.trace(lambda q: ggd.attention(q, q, q, alpha=2.0, beta=1.0, mu=0.0), (q,))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_autocast_runs_the_attention_in_its_dtype_as_sdpa(backend):
    """Under torch.autocast the attention takes q, k, v in the autocast dtype, as
    scaled_dot_product_attention does: q and k in float32 (a float32 rotary table) beside v in
    bfloat16 ran into 'q, k and v must share a dtype', and float32 inputs ran in float32. The
    gradients come back in the inputs' dtypes."""
    torch.manual_seed(0)
    layer = ggd.GeneralizedGaussianAttention(num_heads=4)
    q, k, v = qkv(Hq=4, Hk=2)
    q.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(q, k, v.bfloat16(), backend=backend)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=True)
        values = {name: value.detach() for name, value in layer.prior_params().items()}
        assert ggd.attention(q, k, v, **values, backend=backend).dtype == torch.bfloat16
    assert out.dtype == want.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and layer.raw_alpha.grad.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(out, layer(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                              backend=backend), rtol=0, atol=0)


def test_autocast_runs_a_logit_that_is_not_s_plus_f_d():
    """BAM-SSMax's logit is not s + f(d), so the CPU runs its general path, whose own float32
    matmuls autocast recast to bfloat16: the in-place P @ V into the float32 accumulator raised
    'Input dtypes must be the same'. Under autocast it gives what bfloat16 inputs give without,
    and its backward the same gradients."""
    import bamgen
    ssmax = bamgen.load("bam_ssmax")
    torch.manual_seed(0)
    layer = ssmax.BamSsmaxAttention(num_heads=4)
    q, k, v = qkv(Hq=4, Hk=2, Nq=40, Nk=40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(q, k, v)
    out.float().sum().backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    want = layer(q.bfloat16(), k.bfloat16(), v.bfloat16())
    want.float().sum().backward()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=0, atol=0)
    values = {name: value.detach() for name, value in layer.prior_params().items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):   # the block API takes bfloat16 too
        block = ssmax.forward_block(q, k, v, **values)
    bf = [t.bfloat16() for t in (q, k, v)]
    for got_part, want_part in zip(block, ssmax.forward_block(*bf, **values)):
        torch.testing.assert_close(got_part, want_part, rtol=0, atol=0)


def test_module_parameters_stay_in_domain_and_train():
    attn = ggd.GeneralizedGaussianAttention(num_heads=4)
    names = sorted(n for n, _ in attn.named_parameters())
    assert names == ["raw_alpha", "raw_beta", "raw_mu"]
    values = attn.prior_params()
    for name, expected in ggd.default_params(4).items():
        assert torch.allclose(values[name], expected)
    q, k, v = qkv()
    with torch.no_grad():
        attn.raw_beta.fill_(-30.0)         # beta = exp(-30) > 0: still in its domain
    attn(q, k, v).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in attn.parameters())
    with pytest.raises(ValueError, match="num_heads"):
        attn(*qkv(Hq=2, Hk=2))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rows_that_see_no_key_are_zero_with_zero_gradients(backend):
    q, k, v = (t.requires_grad_() for t in qkv(Nq=6, Nk=8))
    out = ggd.attention(q, k, v, **P, causal=True, q_offset=0, k_offset=3, backend=backend)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    out.sum().backward()
    assert torch.equal(q.grad[:, :, :3], torch.zeros_like(q.grad[:, :, :3]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("positions", [False, True], ids=["offsets", "position_tensors"])
@pytest.mark.parametrize("Hk", [4, 2], ids=["mha", "gqa"])
def test_the_result_is_a_tensor_of_its_own_not_a_view(backend, positions, Hk):
    """FSDP2 warns of a wrapped module that returns a view, and a view output of an autograd
    Function refused `out.mul_(2)` outright. The result owns its memory; an in-place edit is
    then caught by the backward that needs it, as SDPA's is, and an edit of a copy is free."""
    torch.manual_seed(3)
    q, k, v = (t.requires_grad_() for t in qkv(Hq=4, Hk=Hk, Nq=9, Nk=9))
    pos = dict(pos_q=torch.arange(9.0)[None], pos_k=torch.arange(9.0)[None]) if positions else {}
    with torch.no_grad():
        out = ggd.attention(q, k, v, **P, backend=backend, **pos)
    assert out._base is None and not out._is_view()
    out = ggd.attention(q, k, v, **P, backend=backend, **pos)
    assert out._base is None and not out._is_view()
    edited = out.clone()
    edited.mul_(2)
    edited.sum().backward()
    assert q.grad is not None
    out = ggd.attention(q, k, v, **P, backend=backend, **pos)
    out.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_uniform_matches_sdpa():
    q, k, v = qkv(Hq=2, Hk=2, Nq=40, Nk=40)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(uniform.attention(q, k, v, causal=True), expected, atol=1e-5)


def test_module_imports_no_triton_on_cpu():
    import subprocess
    code = ("import sys, torch; from generated import laplace; "
            "q = torch.randn(1, 2, 5, 16); laplace.attention(q, q, q, b=2.0); "
            "print('triton' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=str(__import__("tests.helpers").helpers.ROOT))
    assert res.stdout.strip() == "False", res.stderr


# ----------------------------------------------------------------------------------------
# A call's host work: what would wait for a GPU's queue. On a GPU, reading a value on the host
# (a domain test) and copying host data to the device (a float parameter made a tensor, then
# moved) each wait for every kernel queued before them, so a loop cannot run ahead of the GPU
# (docs/performance.md, "Where a call's host time goes").


class _Launches:
    """Kernels that launch nothing: the host code of a GPU-path call, alone."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _host_ops(call):
    """The aten ops a call dispatches, by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Record() as record:
        call()
    return record.names


@pytest.mark.parametrize("nq", [1, 17], ids=["decode", "prefill"])
def test_a_call_that_repeats_its_parameters_reads_and_copies_nothing(monkeypatch, nq):
    """GGD with alpha a tensor and beta, mu floats, on the Triton path (its kernels skipped):
    the floats become tensors where they are used (torch.full: no host tensor to copy), and the
    domain test neither reads alpha again nor makes a host tensor, the second call on."""
    from bamgen.runtime.triton import launch
    from bamgen.runtime.triton.variant import KernelVariant
    kernels = ggd._prior.kernels()
    monkeypatch.setattr(ggd._prior, "_kernels",
                        KernelVariant({name: _Launches() for name in kernels.kernels}, kernels.namespace))
    q, k, v = qkv(Nq=nq, Nk=23)
    alpha = torch.full((4,), 2.0)

    def call():
        with launch.pinned(table="device"):   # (as CUDA tensors build it; the interpreter's default is the host)
            ggd.attention(q, k, v, alpha=alpha, beta=2.0, mu=0.0, q_offset=23 - nq, backend="triton")

    call()
    ops = _host_ops(call)
    assert "_local_scalar_dense" not in ops and "lift_fresh" not in ops, ops
    assert "_to_copy" not in ops and "copy_" not in ops, ops
    assert ops.count("full") == 2   # beta and mu


@pytest.mark.parametrize("nq", [1, 17], ids=["decode", "prefill"])
def test_a_call_of_a_prior_without_parameters_fills_nothing(monkeypatch, nq):
    """NoPE on the Triton path (its kernels skipped): its empty parameter block and the key
    counts it does not read are placeholders, not filled tensors (a fill is a launch on a GPU)."""
    from bamgen.runtime.triton.variant import KernelVariant
    kernels = uniform._prior.kernels()
    monkeypatch.setattr(uniform._prior, "_kernels",
                        KernelVariant({name: _Launches() for name in kernels.kernels}, kernels.namespace))
    q, k, v = qkv(Nq=nq, Nk=23)
    ops = _host_ops(lambda: uniform.attention(q, k, v, q_offset=23 - nq, backend="triton"))
    assert not {"zeros", "zero_", "fill_", "full", "new_zeros"} & set(ops), ops


READS = {"min", "max", "stack", "_local_scalar_dense"}   # (and HOST_READS.reads: tolist, uploads)


@pytest.mark.parametrize("layout", ["left padding", "packed documents"])
def test_a_layout_passed_again_within_one_forward_is_not_read_again(monkeypatch, layout):
    """A model's layers hand every attention call the same layout tensors: per-row offsets
    (left padding) or cu_seqlens (packed documents, int32 as collators make them). On a GPU the
    host's reads of them (and the upload of the kernels' work lists) wait for the queue. Within
    kept() (one forward) the first call reads them, a second reads nothing while they are
    unchanged, and an in-place write is read again; a call after the forward reads anew.
    (CPU tensors are read every call: reads_wait stands in for a GPU's.)"""
    from bamgen.runtime import host_reads
    from bamgen.runtime.triton import launch
    from bamgen.runtime.triton.variant import KernelVariant
    monkeypatch.setattr(host_reads, "reads_wait", lambda tensor: True)
    kernels = ggd._prior.kernels()
    monkeypatch.setattr(ggd._prior, "_kernels",
                        KernelVariant({name: _Launches() for name in kernels.kernels}, kernels.namespace))
    alpha = torch.full((4,), 2.0)
    if layout == "left padding":
        q, k, v = qkv(B=2, Nq=1, Nk=23)
        pad = torch.tensor([3, 0])
        kwargs = dict(q_offset=22 - pad, k_offset=-pad, key_mask=torch.arange(23)[None] >= pad[:, None])
        written = kwargs["q_offset"]
    else:
        q, k, v = qkv(B=1, Nq=23, Nk=23)
        written = torch.tensor([0, 5, 17, 23], dtype=torch.int32)
        kwargs = dict(cu_seqlens_q=written, cu_seqlens_k=written)

    def reads():
        before = host_reads.HOST_READS.reads
        with launch.pinned(table="device"):
            ops = _host_ops(lambda: ggd.attention(q, k, v, alpha=alpha, beta=2.0, mu=0.0,
                                                  backend="triton", **kwargs))
        return host_reads.HOST_READS.reads - before, READS & set(ops)

    with host_reads.kept():
        assert reads()[0] > 0
        assert reads() == (0, set())
        written.add_(0)   # (an in-place write: the version moves)
        assert reads()[0] > 0
        assert reads() == (0, set())
    assert not host_reads.HOST_READS.kept   # (forgotten when the forward ends)
    assert reads()[0] > 0 and reads()[0] > 0   # (outside a forward: every call reads)


def test_a_compiled_graph_s_layouts_are_read_afresh_within_kept(monkeypatch):
    """A compiled graph hands a dead buffer to a new tensor and fills it with its own kernel,
    which moves no version: two packed layouts made one after the other in one graph share a
    tensor object. The custom ops, which the graph runs, read their layout afresh even within
    kept() (the second call used the first layout's documents: off by 2.7)."""
    from bamgen.runtime import host_reads
    monkeypatch.setattr(host_reads, "reads_wait", lambda tensor: True)

    def f(q, k, v, len1, len2):
        cu1 = torch.nn.functional.pad(torch.cumsum(len1, 0), (1, 0)).to(torch.int32)
        a = ggd.attention(q, k, v, **P, cu_seqlens_q=cu1, cu_seqlens_k=cu1, backend="torch")
        cu2 = torch.nn.functional.pad(torch.cumsum(len2, 0), (1, 0)).to(torch.int32)
        return ggd.attention(a, k, v, **P, cu_seqlens_q=cu2, cu_seqlens_k=cu2, backend="torch")

    torch.manual_seed(0)
    q, k, v = qkv(B=1, Hq=2, Hk=2, Nq=23, Nk=23)
    lengths = torch.tensor([5, 12, 6]), torch.tensor([10, 2, 11])
    want = f(q, k, v, *lengths)
    with host_reads.kept():
        got = torch.compile(f, fullgraph=True)(q, k, v, *lengths)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("key_mask", [False, True])
def test_key_counts_span_every_row_the_kernels_address(key_mask):
    """The kernels load each query row's key count n at NRow + row, whether the prior reads n or
    not: the counts of a prior that does not (NoPE, GGD) span the rows, as a prior's that does
    (BAM-SSMax), or the interpreter reads past them."""
    from generated import bam_ssmax
    from bamgen.runtime.tables import row_key_counts
    B, Nq, Nk = 3, 17, 23
    mask = torch.rand(B, Nk) > 0.3 if key_mask else None
    for module in (uniform, ggd, bam_ssmax):
        counts = row_key_counts(module._prior, B, Nq, Nk, Nk - Nq, 0, True, "cpu", key_mask=mask)
        assert counts.shape == (B, Nq) and counts.stride(1) == 1, module.__name__
        last = (B - 1) * counts.stride(0) + Nq - 1   # the last element a load addresses
        assert counts.untyped_storage().nbytes() >= 4 * (last + 1), module.__name__


def test_the_domain_test_remembers_a_tensor_until_it_changes():
    """A tensor found in its domain is not read again while it is the same object at the same
    version (in-place writes bump it): a meta-device theta, which cannot be read, shows the skip.
    Changed in place, or a new object, it is tested again, and a bad value is refused."""
    check = ggd._prior.domain_check
    alpha = torch.full((4,), 2.0)
    theta = torch.tensor([[2.0, 1.0, 0.0]] * 4)
    check(theta, sources=[alpha, 1.0, 0.0])
    check(theta.to("meta"), sources=[alpha, 1.0, 0.0])   # remembered: nothing read
    with pytest.raises(RuntimeError, match="meta"):   # a tensor it has not seen: read
        check(theta.to("meta"), sources=[alpha.clone(), 1.0, 0.0])
    with pytest.raises(RuntimeError, match="meta"):   # a number outside its domain: read, for its message
        check(theta.to("meta"), sources=[alpha, -1.0, 0.0])
    alpha[1] = -3.0   # in place: a new version
    with pytest.raises(ValueError, match="alpha must be positive .* got -3.0 for head 1"):
        ggd.attention(*qkv(), alpha=alpha, beta=1.0, mu=0.0)


@pytest.mark.parametrize("value, shown", [(-1.0, "-1.0"), (float("nan"), "nan"), (0.0, "0.0"),
                                          (1e-50, "0.0"), (1e39, "inf"), (10 ** 400, "inf")])
def test_a_float_outside_its_domain_is_refused_as_before(value, shown):
    """As float32 holds it (the kernels' value): 1e-50 is 0, 1e39 and a huge int infinite."""
    with pytest.raises(ValueError, match=f"beta must be positive .* got {shown} for head 0"):
        ggd.attention(*qkv(), alpha=2.0, beta=value, mu=0.0)


def test_an_init_guarded_by_a_condition_on_h_computes_only_its_branch(tmp_path):
    """An init whose branch divides by H - 1 under H > 1: default_params(1) takes the other
    branch, as the formula says, rather than computing every part of the formula first (a
    ZeroDivisionError at H = 1, from parts hoisted out of the per-head lambda)."""
    import bamgen
    path = tmp_path / "guarded.yaml"
    path.write_text('name: guarded\nlog_prior: -Abs(d)/b\nparams:\n'
                    '  b: {init: "Piecewise((1 + 1/(H - 1) + h/(H - 1), H > 1), (1, True))", '
                    'domain: positive}\n')
    guarded = bamgen.load(path, cache_dir=tmp_path / "cache")
    assert guarded.default_params(1)["b"].tolist() == [1.0]
    assert guarded.default_params(3)["b"].tolist() == [1.5, 2.0, 2.5]
