"""Positions as tensors (docs/positions.md), from the user's side: the Forgetting Transformer's
cumulative log forget gates, 2-D patch grids for cross-attention, random integer positions
through a shipped prior, and the errors of a wrong call. Every value and gradient is held to a
float64 attention written here with its bias materialised ([B, Hq, Nq, Nk]), the positions'
gradients included (through autograd of that materialised bias)."""
from __future__ import annotations

import importlib

import pytest
import torch

import bamgen
from tests.helpers import write_prior
from tests.reference import reference_attention
from tests.runtime.test_library import LIBRARY, as_reference, fold_shared
from tests.tolerance import assert_all_close, atol_for


def _materialised(q, k, v, bias, causal, key_mask=None, cdt=torch.float64):
    """softmax(q k^T / sqrt(D) + bias) v in cdt, bias [B or 1, Hq or 1, Nq, Nk]; GQA by
    repeating k and v; a row that sees no key is 0."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1).to(cdt), v.repeat_interleave(G, 1).to(cdt)
    s = q.to(cdt) @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + bias.to(cdt)
    Nq, Nk = s.shape[-2:]
    visible = torch.ones(Nq, Nk, dtype=torch.bool)
    if causal:
        visible = torch.ones(Nq, Nk, dtype=torch.bool).tril(Nk - Nq)
    visible = visible.expand_as(s)
    if key_mask is not None:
        visible = visible & key_mask[:, None, None, :]
    s = s.masked_fill(~visible, -float("inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


def _check(mine, build, dtype, wrt, grad_out):
    """The output and the gradients of every tensor in wrt against build(float64), the
    materialised attention from the same leaves, within docs/architecture.md's tolerance for
    dtype: 2 max|pt - ref| + atol, pt = build(dtype) (float64 itself: within 1e-10)."""
    got = torch.autograd.grad(mine, wrt, grad_out.to(mine.dtype))
    ref = build(torch.float64)
    want = torch.autograd.grad(ref, wrt, grad_out.double())
    if dtype == torch.float64:
        for g, w in zip((mine, *got), (ref, *want)):
            torch.testing.assert_close(g.detach(), w.detach(), rtol=1e-10, atol=1e-10)
        return
    pt = build(dtype)
    naive = torch.autograd.grad(pt, wrt, grad_out.to(dtype))
    results = [("out", mine.detach().double(), ref.detach(), pt.detach().double(), None)]
    for n, (g, w, p) in enumerate(zip(got, want, naive)):
        results.append((f"grad {n}", g.double(), w, p.double(), None))
    assert_all_close(results, dtype)


FOX = importlib.import_module("generated.forget_gate")
ALIBI_2D = importlib.import_module("generated.alibi_2d")
GGD = importlib.import_module("generated.generalized_gaussian")


# (backend, dtype): the Triton kernels run under TRITON_INTERPRET=1 (float64: torch only)
PATHS = [("torch", torch.float64), ("torch", torch.float32), ("triton", torch.float32)]


@pytest.mark.parametrize("backend,dtype", PATHS)
@pytest.mark.parametrize("B,Hq,Hk,N", [(1, 1, 1, 1), (2, 4, 2, 17), (1, 2, 1, 123)])
def test_forget_gate_per_head_gates_with_gradients(B, Hq, Hk, N, backend, dtype):
    """FoX: c = logsigmoid(gates).cumsum(-1) per query head, pos_q = pos_k = c, `log_prior: d`.
    The gates get their gradient through the cumsum (the keys' positions under GQA too)."""
    g = torch.Generator().manual_seed(N)
    q = torch.randn(B, Hq, N, 16, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hk, N, 16, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hk, N, 16, generator=g, dtype=dtype, requires_grad=True)
    gates = (torch.randn(B, Hq, N, generator=g, dtype=dtype) + 2.0).requires_grad_(True)
    c = torch.nn.functional.logsigmoid(gates).cumsum(-1)
    out = FOX.attention(q, k, v, causal=True, pos_q=c, pos_k=c, backend=backend)

    def build(cdt):
        c = torch.nn.functional.logsigmoid(gates.to(cdt)).cumsum(-1)
        return _materialised(q, k, v, c[..., :, None] - c[..., None, :], True, cdt=cdt)
    _check(out, build, dtype, (q, k, v, gates), torch.randn(out.shape, generator=g))


@pytest.mark.parametrize("backend,dtype", PATHS)
@pytest.mark.parametrize("B,Hq,Hk,N", [(2, 4, 2, 17), (1, 2, 1, 123)])
def test_forget_gates_with_padding_keys_get_the_reference_gradients(B, Hq, Hk, N, backend, dtype):
    """A FoX batch with padding (key_mask): no query sees a padding key, so its position gets
    no gradient, and the gates, whose cumsum feeds every later position, get the reference's.
    The Triton dK/dV kernel summed a padding key's dS into its position (4.1 off for one
    key of eight, d gates off by 0.6): an outside test, 2026-11-28."""
    g = torch.Generator().manual_seed(N + 1)
    q = torch.randn(B, Hq, N, 16, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hk, N, 16, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hk, N, 16, generator=g, dtype=dtype, requires_grad=True)
    gates = (torch.randn(B, Hq, N, generator=g, dtype=dtype) + 2.0).requires_grad_(True)
    key_mask = torch.rand(B, N, generator=g) > 0.3
    key_mask[:, 0] = True   # (every row sees a key)
    c = torch.nn.functional.logsigmoid(gates).cumsum(-1)
    out = FOX.attention(q, k, v, causal=True, pos_q=c, pos_k=c, key_mask=key_mask, backend=backend)

    def build(cdt):
        c = torch.nn.functional.logsigmoid(gates.to(cdt)).cumsum(-1)
        return _materialised(q, k, v, c[..., :, None] - c[..., None, :], True, key_mask, cdt=cdt)
    _check(out, build, dtype, (q, k, v, gates), torch.randn(out.shape, generator=g))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_padding_key_s_position_gets_no_gradient_even_if_nan(backend):
    """GGD over float positions, keys 3 and 5 padding with NaN positions: their positions'
    gradients are 0, the others' finite and as with any finite value there."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    key_mask = torch.ones(1, 8, dtype=torch.bool)
    key_mask[0, [3, 5]] = False
    grads = []
    for fill in (float("nan"), 2.5):
        pos_k = torch.arange(8.0)[None].clone()
        pos_k[0, [3, 5]] = fill
        pos_k.requires_grad_(True)
        out = GGD.attention(q, k, v, alpha=3.0, beta=1.5, mu=0.0, causal=False,
                            pos_q=torch.arange(8.0)[None], pos_k=pos_k, key_mask=key_mask,
                            backend=backend)
        (grad,) = torch.autograd.grad(out.square().sum(), pos_k)
        grads.append(grad)
    assert (grads[0][0, [3, 5]] == 0).all() and torch.isfinite(grads[0]).all(), grads[0]
    assert torch.equal(grads[0], grads[1])
    assert grads[0][0, [0, 1, 2, 4, 6, 7]].abs().min() > 0


@pytest.mark.parametrize("backend,dtype", PATHS)
def test_forget_gate_module_and_shared_positions(backend, dtype):
    """The module's forward takes pos_q / pos_k; positions [B, N] shared by the heads get the
    gradient summed over them."""
    g = torch.Generator().manual_seed(3)
    B, H, N = 2, 3, 29
    q, k, v = (torch.randn(B, H, N, 8, generator=g, dtype=dtype, requires_grad=True)
               for _ in range(3))
    c = torch.randn(B, N, generator=g, dtype=dtype).cumsum(-1).requires_grad_(True)
    layer = FOX.ForgetGateAttention(num_heads=H)
    out = layer(q, k, v, causal=True, pos_q=c, pos_k=c, backend=backend)
    _check(out, lambda cdt: _materialised(q, k, v, (c.to(cdt)[:, None, :, None]
                                                    - c.to(cdt)[:, None, None, :]), True, cdt=cdt),
           dtype, (q, k, v, c), torch.randn(out.shape, generator=g))


@pytest.mark.parametrize("backend,dtype", PATHS)
def test_alibi_2d_cross_attention_between_grids(backend, dtype):
    """Queries on a 3 x 4 grid, keys on a 5 x 5 grid (Nq != Nk), per-head slopes learnt, float
    positions with gradients (a patch's coordinates moved by a learnt offset)."""
    g = torch.Generator().manual_seed(5)
    B, H = 2, 4
    shift = torch.randn(B, 12, 2, generator=g, dtype=dtype).mul(0.3).requires_grad_(True)
    pq = bamgen.positions.grid(3, 4, dtype=dtype)[None] + shift
    pk = bamgen.positions.grid(5, 5, dtype=dtype).expand(B, -1, -1)
    assert pk.shape == (B, 25, 2)
    q = torch.randn(B, H, 12, 16, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(B, H, 25, 16, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(B, H, 25, 16, generator=g, dtype=dtype, requires_grad=True)
    b = torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float32, requires_grad=True)
    out = ALIBI_2D.attention(q, k, v, b=b, causal=False, pos_q=pq, pos_k=pk, backend=backend)

    def build(cdt):
        dist = (pq.to(cdt)[:, :, None, :] - pk.to(cdt)[:, None, :, :]).abs().sum(-1)
        return _materialised(q, k, v, -dist[:, None] / b.to(cdt)[None, :, None, None], False,
                             cdt=cdt)
    _check(out, build, dtype, (q, k, v, b, shift), torch.randn(out.shape, generator=g))


def test_a_prior_over_channels_documents_only_the_positions_it_takes():
    """help(attention) of a prior over two channels gives its [.., 2] shapes and its own
    symbols: it also offered the one channel's [B, N] or [B, Hq, N], which it refuses, and
    named i, j and d, which its formulas do not have."""
    doc = " ".join(ALIBI_2D.attention.__doc__.split())
    assert "pos_q, pos_k: positions as tensors (docs/positions.md): [B, N, 2] or [B, Hq, N, 2], " \
        "required, float or integer" in doc, doc
    assert "the formula's i0..i1, j0..j1 and d0..d1 come from them" in doc, doc
    assert "[B, N] or" not in doc and "i, j and d" not in doc, doc
    with pytest.raises(ValueError, match="pos_q"):
        ALIBI_2D.attention(*(torch.randn(1, 1, 4, 8) for _ in range(3)), b=1.0,
                           pos_q=torch.zeros(1, 4), pos_k=torch.zeros(1, 4))

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_random_integer_positions_through_a_shipped_prior(backend):
    """Randomized positional encodings (Ruoss et al.): sorted random integers drawn from a range
    8x the length, through the shipped GGD prior, with a key_mask hiding padding keys."""
    g = torch.Generator().manual_seed(11)
    B, H, N = 2, 2, 40
    pos = torch.sort(torch.randperm(8 * N, generator=g)[:N]).values[None].expand(B, -1)
    q, k, v = (torch.randn(B, H, N, 16, generator=g, requires_grad=True) for _ in range(3))
    alpha = torch.tensor([3.0, 40.0], requires_grad=True)
    beta = torch.tensor([1.0, 1.5], requires_grad=True)
    mu = torch.tensor([0.0, 5.0], requires_grad=True)
    key_mask = torch.ones(B, N, dtype=torch.bool)
    key_mask[1, -7:] = False
    out = GGD.attention(q, k, v, alpha=alpha, beta=beta, mu=mu, causal=True, pos_q=pos,
                        pos_k=pos, key_mask=key_mask, backend=backend)

    def build(cdt):
        d = (pos[:, :, None] - pos[:, None, :]).to(cdt)[:, None]
        a, be, m = (t.to(cdt)[None, :, None, None] for t in (alpha, beta, mu))
        return _materialised(q, k, v, -((d - m).abs() / a) ** be, True, key_mask=key_mask, cdt=cdt)
    _check(out, build, torch.float32, (q, k, v, alpha, beta, mu),
           torch.randn(out.shape, generator=g))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_integer_positions_equal_to_the_token_positions_give_the_offsets_answer(backend):
    """pos = arange(N) + 5 is the call with q_offset = k_offset = 5."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 33, 8, generator=g) for _ in range(3))
    pos = (torch.arange(33) + 5)[None]
    with_pos = GGD.attention(q, k, v, alpha=4.0, beta=1.0, mu=0.0, pos_q=pos, pos_k=pos,
                             backend=backend)
    with_offsets = GGD.attention(q, k, v, alpha=4.0, beta=1.0, mu=0.0, q_offset=5, k_offset=5,
                                 backend=backend)
    torch.testing.assert_close(with_pos, with_offsets, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_decode_step_reads_the_cache_positions(backend):
    """Decode with positions: the new token's position against the cache's, no grad. Masks
    follow token order and the offsets are 0, so a step's one query takes causal=False: it sees
    the whole cache (docs/positions.md)."""
    g = torch.Generator().manual_seed(4)
    B, H, N = 1, 2, 20
    gates = torch.randn(B, H, N + 1, generator=g) + 1.0
    c = torch.nn.functional.logsigmoid(gates).cumsum(-1)
    q = torch.randn(B, H, 1, 8, generator=g)
    k, v = (torch.randn(B, H, N + 1, 8, generator=g) for _ in range(2))
    with torch.no_grad():
        step = FOX.attention(q, k, v, causal=False, pos_q=c[..., -1:], pos_k=c, backend=backend)
    bias = c[..., -1:, None] - c[..., None, :]
    ref = _materialised(q, k, v, bias, False)
    torch.testing.assert_close(step.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_chunk_after_a_cache_takes_its_offset_for_the_causal_mask(backend, compiled):
    """Chunked prefill with FoX's positions: 5 new rows against a cache of 10 (keys 0..14). The
    mask follows token order, so the chunk's rows sit at q_offset = 10 among the keys; the
    positions still come from the tensors. The rows, and the gradients of q, k, v and the
    gates, are the full causal call's (an outside test found the offset refused, and no way
    to mask such a chunk)."""
    g = torch.Generator().manual_seed(6)
    B, H, N, s = 2, 2, 15, 10
    q, k, v = (torch.randn(B, H, N, 16, generator=g, requires_grad=True) for _ in range(3))
    gates = (torch.randn(B, H, N, generator=g) + 2.0).requires_grad_(True)
    c = torch.nn.functional.logsigmoid(gates).cumsum(-1)
    full = FOX.attention(q, k, v, causal=True, pos_q=c, pos_k=c, backend=backend)

    def chunk(q, k, v, c):
        return FOX.attention(q[:, :, s:], k, v, causal=True, q_offset=s, pos_q=c[:, :, s:],
                             pos_k=c, backend=backend)
    call = torch.compile(chunk, fullgraph=True, backend="aot_eager") if compiled else chunk
    rows = call(q, k, v, c)
    torch.testing.assert_close(rows, full[:, :, s:], rtol=1e-5, atol=1e-6)
    dout = torch.randn(rows.shape, generator=g)
    got = torch.autograd.grad(rows, (q, k, v, gates), dout, retain_graph=True)
    want = torch.autograd.grad(full[:, :, s:], (q, k, v, gates), dout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call,argument", [
    (lambda q, p: ALIBI_2D.attention(q, q, q, b=1.0), "pos_q"),
    (lambda q, p: FOX.attention(q, q, q, pos_q=p), "pos_k"),
    (lambda q, p: FOX.attention(q, q, q, pos_q=p, pos_k=p[:, :5]), "pos_k"),
    (lambda q, p: FOX.attention(q, q, q, pos_q=p[..., None], pos_k=p[..., None]), "pos_q"),
    (lambda q, p: FOX.attention(q, q, q, pos_q=p > 0, pos_k=p > 0), "pos_q"),
    (lambda q, p: FOX.attention(q, q, q, pos_q=p, pos_k=p, q_offset=torch.tensor([3])), "q_offset"),
    (lambda q, p: FOX.attention(q, q, q, pos_q=p, pos_k=p, q_offset=3.0),
     "q_offset must be an int when pos_q and pos_k are given"),
    # integers float32 cannot hold: 2**24 + 13 and 2**24 + 12 would read alike
    (lambda q, p: GGD.attention(q, q, q, alpha=2.0, beta=1.0, mu=0.0,
                                pos_q=torch.arange(9)[None].expand(2, 9) + 2 ** 24 + 4,
                                pos_k=torch.arange(9)[None].expand(2, 9)), r"pos_q holds 16777228"),
    (lambda q, p: GGD.attention(q, q, q, alpha=2.0, beta=1.0, mu=0.0,
                                pos_q=torch.arange(9)[None].expand(2, 9),
                                pos_k=-torch.arange(9)[None].expand(2, 9) - 2 ** 24), r"pos_k holds -16777224"),
    # each within 2**24, their distances beyond (2**24 and 1 - 2**24 read 2**25 - 1 apart)
    (lambda q, p: GGD.attention(q, q, q, alpha=2.0, beta=1.0, mu=0.0,
                                pos_q=torch.full((2, 9), 2 ** 24), pos_k=-torch.arange(9)[None].expand(2, 9)
                                - 2 ** 24 + 9), r"pos_q and pos_k .*reach 33554431, beyond 2\*\*24"),
    (lambda q, p: ALIBI_2D.attention(q, q, q, b=1.0, pos_q=p, pos_k=p), "pos_q"),
])
def test_wrong_positions_name_the_argument(call, argument):
    """Each refused, naming the argument: a bad shape, dtype or offset, and integer positions
    beyond float32's integers (an outside test found 2**24 + 13 silently off by 0.84), or
    whose distances are (one at 2**24 and keys near -2**24: Laplace's weights off by 0.2 on
    the CPU path and 0.24 in the kernels, which disagreed with each other; token offsets that
    far apart were already refused)."""
    q = torch.randn(2, 2, 9, 8)
    p = torch.randn(2, 9)
    with pytest.raises(ValueError, match=argument):
        call(q, p)


FAR_INTEGERS = [   # (pos_q, pos_k, the refusal): each beyond what float32 holds exactly
    (torch.arange(9)[None] + 2 ** 24 + 4, torch.arange(9)[None], r"pos_q holds 16777228"),
    (torch.arange(9.0)[None], -torch.arange(9)[None] - 2 ** 24, r"pos_k holds -16777224"),
    (torch.full((1, 9), 2 ** 24), -torch.arange(9)[None] - 2 ** 24 + 9,
     r"pos_q and pos_k .*reach 33554431, beyond 2\*\*24"),
]


@pytest.mark.parametrize("pos_q,pos_k,refusal", FAR_INTEGERS, ids=["pos_q", "pos_k", "distances"])
@pytest.mark.parametrize("call", ["attention", "module"])
def test_far_integer_positions_are_refused_under_a_fullgraph_compile(call, pos_q, pos_k, refusal):
    """The integer-position checks above, in a compiled model: they read values, which a trace
    does not have, so a compiled call ran 2**24 + 4 as if it were 2**24 + 3 or 5 (float32),
    silently. The positional custom op now makes eager's checks on the tensors' bounds, taken
    in the graph: the same ValueError, fullgraph, from attention() and from the nn.Module; the
    compiled call at nearby positions gives eager's output."""
    torch._dynamo.reset()
    layer = GGD.GeneralizedGaussianAttention(2)

    def step(q, pos_q, pos_k):
        if call == "module":
            return layer(q, q, q, causal=False, pos_q=pos_q, pos_k=pos_k)
        return GGD.attention(q, q, q, causal=False, alpha=2.0, beta=1.0, mu=0.0, pos_q=pos_q,
                             pos_k=pos_k)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    q = torch.randn(1, 2, 9, 8)
    with pytest.raises(ValueError, match=refusal):
        compiled(q, pos_q, pos_k)
    near = (pos_q - pos_q.min(), pos_k - pos_k.min())   # the same dtypes, within the range
    torch.testing.assert_close(compiled(q, *near), step(q, *near))
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), 3e38, -3e38])
def test_infinite_or_far_float_positions_touch_only_the_rows_that_see_them(bad, backend):
    """A float position at an infinity, or finite and far past 2**24 (3e38), among integer
    ones, through GGD (a table prior: integer positions read its table) and FoX: the CPU path
    raised OverflowError (an infinity passed the integer test, then int(inf)) and the kernels'
    choice of a table ValueError at -inf. Such positions now take the per-score kernels and
    behave as a non-finite input (docs/reliability.md): causal rows before the token are those
    of the same call without it, whatever its value (to float32's rounding: the table and the
    per-score kernels round apart)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 8, 8, generator=g) for _ in range(3))
    calls = [lambda p: GGD.attention(q, k, v, alpha=torch.tensor([2.0, 5.0]), beta=1.0, mu=0.0,
                                     pos_q=p, pos_k=p, backend=backend),
             lambda p: FOX.attention(q, k, v, pos_q=-p, pos_k=-p, backend=backend)]
    plain = torch.arange(8.0)[None]
    odd = plain.clone()
    odd[0, 5] = bad
    for call in calls:
        want = call(plain)[:, :, :5]
        torch.testing.assert_close(call(odd)[:, :, :5], want, rtol=0,
                                   atol=atol_for(torch.float32, want))


def test_float_positions_further_apart_than_float32_distances_take_the_per_score_path():
    """Integer-valued float positions each within 2**24 but further apart than that: the CPU
    path's table, built over the exact float64 span, was gathered at the float32 distances,
    which round past it (an IndexError). Both paths now compute them per score, alike."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    pos_q = torch.full((1, 4), 16000001.0)
    pos_k = torch.tensor([[-16000002.0, -16000002.0, -16000001.0, -16000000.0]])
    outs = [GGD.attention(q, k, v, alpha=torch.tensor([4e6, 9e6]), beta=1.0, mu=0.0, causal=False,
                          pos_q=pos_q, pos_k=pos_k, backend=backend) for backend in ("torch", "triton")]
    assert bool(torch.isfinite(outs[0]).all())
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=atol_for(torch.float32, outs[1]))


CORE = {   # the core three, in the library's form (tests/runtime/test_library.py: the others)
    "uniform": (None, None, {}, (), None),
    "laplace": (lambda d, p: -torch.abs(d) / p["b"], None, {"b": [1.0, 4.0, 0.5, 16.0]}, ("b",),
                lambda d, p: d == 0),
    "generalized_gaussian": (lambda d, p: -(torch.abs(d - p["mu"]) / p["alpha"]) ** p["beta"],
                             None, {"alpha": [2.0, 5.0, 9.0, 30.0], "beta": [1.0, 1.5, 2.0, 0.8],
                                    "mu": [0.0, 1.5, 3.0, -2.0]}, ("alpha", "beta", "mu"),
                             lambda d, p: d - p["mu"] == 0),
}


# FIRE's positional kernels take 40 s under the interpreter: make test-full runs them
SHIPPED = [pytest.param(name, backend, marks=[pytest.mark.full] if (name, backend) == ("fire", "triton")
                        else [], id=f"{name}-{backend}")
           for name in sorted(set(LIBRARY) | set(CORE)) for backend in ("torch", "triton")]


@pytest.mark.parametrize("name,backend", SHIPPED)
def test_every_shipped_prior_over_float_positions(name, backend):
    """Every shipped prior of one channel over per-head float positions (a learnt warp of the
    token positions: steps between 0.5 and 1.5), GQA, causal: the output and the gradients of
    q, k, v, every learnable parameter and both position tensors, against the float64
    reference (tests/reference.py, positions=). T5 buckets integer distances (its reference is
    transformers' own bucketing of integers): it takes random increasing integer positions,
    held in a float tensor that requires grad (their gradient is 0: a bucket is a step)."""
    log_prior, score, values, learnable, kink = {**LIBRARY, **CORE}[name]
    module = importlib.import_module(f"generated.{name}")
    g = torch.Generator().manual_seed(7)
    B, Hq, Hk, N, D = 1, 4, 2, 29, 16
    q, dout = (torch.randn(B, Hq, N, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, Hk, N, D, generator=g) for _ in range(2))
    pos = (0.5 + torch.rand(B, Hq, N, generator=g)).cumsum(-1)
    pos_q, pos_k = pos + 0.25 * torch.rand(B, Hq, N, generator=g), pos
    if name.startswith("t5"):
        pos_q = pos_k = torch.randint(1, 9, (B, Hq, N), generator=g).cumsum(-1).float()
    params = {n: torch.tensor(vals) for n, vals in values.items()}
    leaves = [t.clone().requires_grad_() for t in (q, k, v, pos_q, pos_k)]
    p_leaves = {n: t.clone().requires_grad_(n in learnable) for n, t in params.items()}
    out = module.attention(*leaves[:3], **p_leaves, causal=True, pos_q=leaves[3], pos_k=leaves[4],
                           backend=backend)
    wrt = leaves + [p_leaves[n] for n in learnable]
    out, *grads = (out, *torch.autograd.grad(out, wrt, dout))
    kw = dict(causal=True, score=score, kink=kink, dout=dout, positions=(pos_q, pos_k))
    ref_params = as_reference(module, params)
    ref = reference_attention(q, k, v, ref_params, log_prior, **kw)
    pt = reference_attention(q, k, v, ref_params, log_prior, compute_dtype=torch.float32, **kw)
    fold_shared(module, ref, pt)
    results = [("out", out, ref.out, pt.out), ("dq", grads[0], ref.dq, pt.dq),
               ("dk", grads[1], ref.dk, pt.dk), ("dv", grads[2], ref.dv, pt.dv)]
    if log_prior is not None:
        results += [("dpos_q", grads[3], ref.dpos_q, pt.dpos_q),
                    ("dpos_k", grads[4], ref.dpos_k, pt.dpos_k)]
    else:   # NoPE: no position moves the logit, so their gradients are exactly 0
        assert not grads[3].any() and not grads[4].any(), name
    results += [(f"d{n}", gr, ref.dparams[n], pt.dparams[n]) for n, gr in zip(learnable, grads[5:])]
    assert all(torch.isfinite(r[1]).all() for r in results)
    assert_all_close(results, torch.float32, context=f"{name} {backend}")


def test_kernels_sum_positions_gradients_only_where_a_position_moves_the_logit():
    """The compiler marks the priors whose logit no position moves (NoPE; T5, whose buckets are
    steps): their kernels of positions as tensors sum no positions' gradients (POSITION_GRADS,
    PriorTraits.position_grads), which are 0, and spend neither work nor registers on them
    (NoPE's dK/dV kernel at head dim 64 on sm_80 spilled 16 bytes doing so)."""
    for name, moves in (("uniform", False), ("t5", False), ("t5_bidirectional", False),
                        ("generalized_gaussian", True), ("forget_gate", True), ("fire", True)):
        module = importlib.import_module(f"generated.{name}")
        assert module._prior.positional.traits.position_grads is moves, name


def _cpu_step(prior, initial, q, k, v, pos, pos_grad=True, **layout):
    """The torch path's gradients of q, k, v, pos (None where pos_grad is False) and every
    parameter (initial: their values), positions shared by queries and keys."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + [pos.clone().requires_grad_(pos_grad)]
    values = {n: t.clone().requires_grad_() for n, t in initial.items()}
    out = prior.attention(*leaves[:3], values, True, None, 0, 0, None, layout.get("cu"),
                          layout.get("cu"), "torch", leaves[3], leaves[3])
    wrt = leaves[:3] + leaves[3:] * pos_grad + list(values.values())
    grads = list(torch.autograd.grad(out.square().sum(), wrt))
    return grads if pos_grad else grads[:3] + [None] + grads[3:]


def _counting_position_hook(monkeypatch, prior) -> list:
    """Replace the prior's torch position_grads hook by one that records each evaluation."""
    import dataclasses
    evaluated, hooks = [], prior.torch
    monkeypatch.setattr(prior, "torch", dataclasses.replace(
        hooks, position_grads=lambda *a: evaluated.append(1) or hooks.position_grads(*a)))
    return evaluated


def _assert_same_grads(got, want):
    for g, w in zip(got, want):
        if g is not None and w is not None:
            assert torch.equal(g, w)


def _cpu_inputs(prior, N=40, channels=1):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, N, 16, generator=g) for _ in range(3))
    pos = torch.randint(1, 5, (1, N, channels), generator=g).cumsum(1).float().squeeze(-1)
    torch.manual_seed(3)
    return q, k, v, pos, prior.default_params(2)   # (T5's are drawn at random: once)


@pytest.mark.parametrize("name, moves", [("t5", False), ("t5_bidirectional", False),
                                         ("generalized_gaussian", True)])
def test_the_cpu_path_sums_positions_gradients_only_where_a_position_moves_the_logit(
        monkeypatch, name, moves):
    """The torch path, as the kernels: a prior whose logit no position moves (T5's buckets are
    steps) evaluates no derivative by a position in its backward, and float positions that
    require grad get zeros; every other gradient is the summing backward's, bit for bit."""
    import dataclasses
    prior = importlib.import_module(f"generated.{name}")._prior
    q, k, v, pos, initial = _cpu_inputs(prior)
    # the backward that sums them, for the other gradients
    monkeypatch.setattr(prior, "traits", dataclasses.replace(prior.traits, position_grads=True))
    summing = _cpu_step(prior, initial, q, k, v, pos)
    monkeypatch.undo()
    evaluated = _counting_position_hook(monkeypatch, prior)
    grads = _cpu_step(prior, initial, q, k, v, pos)
    assert bool(evaluated) is moves
    if not moves:
        assert grads[3].shape == pos.shape and not grads[3].any()
    _assert_same_grads(grads, summing)


@pytest.mark.parametrize("name, channels, packed", [
    ("generalized_gaussian", 1, False), ("generalized_gaussian", 1, True), ("alibi_2d", 2, False)])
def test_the_cpu_path_sums_no_positions_gradients_a_call_does_not_want(
        monkeypatch, name, channels, packed):
    """Positions that do not require grad (a grid, integer positions): the torch path's backward
    evaluates no derivative by a position, and every other gradient is that of the same call
    whose positions require grad, bit for bit (a 16 x 16 grid through ALiBi-2D: its backward
    took 65 ms with the sums, 43 ms without, on one CPU thread)."""
    prior = importlib.import_module(f"generated.{name}")._prior
    q, k, v, pos, initial = _cpu_inputs(prior, channels=channels)
    layout = {"cu": torch.tensor([0, 13, 40], dtype=torch.int32)} if packed else {}
    wanted = _cpu_step(prior, initial, q, k, v, pos, **layout)
    evaluated = _counting_position_hook(monkeypatch, prior)
    grads = _cpu_step(prior, initial, q, k, v, pos, pos_grad=False, **layout)
    assert not evaluated and wanted[3].any()
    _assert_same_grads(grads, wanted)


class FoxLayer(torch.nn.Module):
    """docs/positions.md's FoX layer: gates from a projection, positions their log-sigmoid sums."""

    def __init__(self, d_model=32, heads=4):
        super().__init__()
        self.h = heads
        self.qkv = torch.nn.Linear(d_model, 3 * d_model, bias=False)
        self.fgate = torch.nn.Linear(d_model, heads)
        self.out = torch.nn.Linear(d_model, d_model, bias=False)
        self.attn = FOX.ForgetGateAttention(num_heads=heads)

    def forward(self, x, backend="auto"):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4)
        pos = torch.nn.functional.logsigmoid(self.fgate(x)).transpose(1, 2).cumsum(-1)
        y = self.attn(q, k, v, causal=True, pos_q=pos, pos_k=pos, backend=backend)
        return self.out(y.transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_fox_layer_compiles_fullgraph_once_for_every_length(backend):
    """torch.compile(fullgraph=True, dynamic=True): the positional custom ops
    (torch.ops.bamgen.forget_gate_<op hash>_pfwd / _pbwd) take the position tensors; three lengths, one
    graph, no break, and the step's output and every gradient (the gates' included) equal to
    eager's."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    layer = FoxLayer()
    compiled = torch.compile(lambda x: layer(x, backend), fullgraph=True, dynamic=True,
                             backend="aot_eager")
    for n in (17, 40, 65):
        x = torch.randn(2, n, 32)
        steps = []
        for fn in (compiled, lambda x: layer(x, backend)):
            layer.zero_grad()
            out = fn(x)
            out.square().sum().backward()
            steps.append((out.detach(), {name: p.grad.clone() for name, p in layer.named_parameters()
                                         if p.grad is not None}))
        torch.testing.assert_close(steps[0][0], steps[1][0])
        assert steps[0][1].keys() == steps[1][1].keys() and "fgate.weight" in steps[0][1]
        for name in steps[0][1]:
            torch.testing.assert_close(steps[0][1][name], steps[1][1][name], msg=name)
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_documents_take_their_positions_with_their_tokens(backend):
    """Packed documents (cu_seqlens, B = 1) of 5, 17 and 9 tokens, FoX positions restarting in
    each document (the cumsum of its own gates): the same output and gradients, the gates'
    included, as each document run alone."""
    g = torch.Generator().manual_seed(9)
    lengths = [5, 17, 9]
    cu = torch.tensor([0, 5, 22, 31], dtype=torch.int32)
    H, D = 2, 16
    q, k, v, dout = (torch.randn(1, H, 31, D, generator=g) for _ in range(4))
    gates = (torch.randn(1, H, 31, generator=g) + 2.0)

    def run(packed):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, gates)]
        ls = torch.nn.functional.logsigmoid(leaves[3])
        if packed:
            c = torch.cat([ls[..., a:b].cumsum(-1) for a, b in zip(cu[:-1], cu[1:])], -1)
            out = FOX.attention(*leaves[:3], causal=True, pos_q=c, pos_k=c, cu_seqlens_q=cu,
                                cu_seqlens_k=cu, backend=backend)
        else:
            outs = []
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
                c = ls[..., a:b].cumsum(-1)
                outs.append(FOX.attention(*(t[:, :, a:b] for t in leaves[:3]), causal=True,
                                          pos_q=c, pos_k=c, backend=backend))
            out = torch.cat(outs, 2)
        return (out, *torch.autograd.grad(out, leaves, dout))

    assert sum(lengths) == 31
    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_documents_with_steep_gates_keep_finite_gradients(backend):
    """Documents of 40 and 33 tokens batched together (the CPU path pads the shorter one) with
    gates near -3: a key 39 tokens in sits at c = -120, so a padding row at position 0 would see
    it at logit +120 and exp2 would overflow; the gradients stay finite and equal each
    document's alone (the review of this change found the NaN on the torch path)."""
    g = torch.Generator().manual_seed(10)
    cu = torch.tensor([0, 40, 73], dtype=torch.int32)
    q, k, v, dout = (torch.randn(1, 2, 73, 16, generator=g) for _ in range(4))
    gates = torch.randn(1, 2, 73, generator=g) * 0.1 - 3.0

    def run(packed):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, gates)]
        ls = torch.nn.functional.logsigmoid(leaves[3])
        spans = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
        if packed:
            c = torch.cat([ls[..., a:b].cumsum(-1) for a, b in spans], -1)
            out = FOX.attention(*leaves[:3], causal=True, pos_q=c, pos_k=c, cu_seqlens_q=cu,
                                cu_seqlens_k=cu, backend=backend)
        else:
            out = torch.cat([FOX.attention(*(t[:, :, a:b] for t in leaves[:3]), causal=True,
                                           pos_q=ls[..., a:b].cumsum(-1),
                                           pos_k=ls[..., a:b].cumsum(-1), backend=backend)
                             for a, b in spans], 2)
        return (out, *torch.autograd.grad(out, leaves, dout))

    for got, want in zip(run(True), run(False)):
        assert bool(torch.isfinite(got).all())
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


def _randomized_positions_call(name, causal, per_head, shift, backend, seed):
    """run() -> [out, then the gradients of q, k, v and every parameter] of one call of the
    shipped prior `name` at randomized positions (sorted random integers from a range 3x the
    length, plus `shift`; shared or per head), GQA, a key_mask hiding a row's first keys."""
    module = importlib.import_module(f"generated.{name}")
    g = torch.Generator().manual_seed(seed)
    B, H, Hk, N, D = 2, 4, 2, 37, 16
    q, dout = (torch.randn(B, H, N, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, Hk, N, D, generator=g) for _ in range(2))
    shape = (B, H) if per_head else (B,)
    pos = torch.sort(torch.randperm(3 * N, generator=g)[:N]).values.expand(*shape, N) + shift
    key_mask = torch.ones(B, N, dtype=torch.bool)
    key_mask[1, :5] = False
    params = module.default_params(H)

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        p = {n: t.clone().requires_grad_() for n, t in params.items()}
        out = module.attention(*leaves, **p, causal=causal, pos_q=pos, pos_k=pos,
                               key_mask=key_mask, backend=backend)
        return [out, *torch.autograd.grad(out, leaves + list(p.values()), dout)]
    return run


@pytest.mark.parametrize("name,causal,per_head", [
    ("generalized_gaussian", True, False), ("laplace", False, True), ("t5", True, True),
    ("kerple_log", True, False)])
def test_integer_positions_read_the_distance_table_on_the_cpu(name, causal, per_head, monkeypatch):
    """Randomized positions (sorted random integers from a range 3x the length, Ruoss et al.)
    through a prior in d alone: the CPU path reads the float64 distance table at d = i - j
    (docs/positions.md, "Integer positions") and gives what evaluating the prior per score
    gives, output and every gradient (the parameters' through the table's derivative slots)."""
    from bamgen.runtime.cpu import backward as cpu_backward, forward as cpu_forward, hooks
    run = _randomized_positions_call(name, causal, per_head, 0, "torch", seed=17)
    used = []
    real = hooks.position_tables

    def counting(*args):
        tables = real(*args)
        used.append(tables is not None)
        return tables
    for mod in (cpu_forward, cpu_backward):
        monkeypatch.setattr(mod, "position_tables", counting)
    table = run()
    assert used == [True, True], used            # the forward's table, the backward's
    for mod in (cpu_forward, cpu_backward):
        monkeypatch.setattr(mod, "position_tables", lambda *args: None)
    per_score = run()
    for i, (a, b) in enumerate(zip(table, per_score)):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5, msg=lambda m: f"output {i}: {m}")


def test_float_or_far_apart_positions_keep_the_per_score_path():
    from bamgen.runtime.cpu.hooks import POSITION_TABLE_SPAN, position_tables
    theta = torch.ones(2, 3)
    near = torch.arange(10.0).reshape(1, 1, 10, 1).expand(1, 2, 10, 1)
    assert position_tables(GGD._prior, theta, (near, near), False, True) is not None
    assert position_tables(GGD._prior, theta, (near + 0.5, near), False, True) is None
    far = near * (2 * POSITION_TABLE_SPAN + 1)
    assert position_tables(GGD._prior, theta, (far, far), False, True) is None
    grid = ALIBI_2D.TRAITS   # several channels: per score
    assert grid.channels == 2
    two = near.expand(1, 2, 10, 2)
    assert position_tables(ALIBI_2D._prior, torch.ones(2, 1), (two, two), False, True) is None


def _spy_position_calls(monkeypatch):
    """Record each Triton call's choice for its positions (launch.position_call): the table's
    span of distances, or None where the prior is computed inline."""
    from bamgen.runtime.triton import launch
    spans = []
    real = launch.position_call

    def spy(*args):
        call = real(*args)
        spans.append(call.span)
        return call
    monkeypatch.setattr(launch, "position_call", spy)
    return spans


def _force_inline(monkeypatch):
    from bamgen.runtime.triton import launch
    monkeypatch.setattr(launch, "position_call",
                        lambda prior, pos, grads, extent=None: launch.PositionCall(prior.positional, pos))


@pytest.mark.parametrize("name,causal,per_head,shift", [
    ("generalized_gaussian", True, False, 0), ("kerple_log", True, True, 5000),
    ("gaussian", False, True, -77), ("cauchy", False, False, 2 ** 23), ("sandwich", True, True, 9)])
def test_integer_positions_read_the_distance_table_in_the_triton_kernels(name, causal, per_head,
                                                                        shift, monkeypatch):
    """Randomized positions (sorted random integers from a range 3x the length, Ruoss et al.)
    through a table prior, GQA and a key_mask, the positions anywhere (shifted by up to 2**23):
    the Triton kernels read the prior's distance table at d = pos_i - pos_j, forward and
    backward (docs/positions.md, "Integer positions"), and give what its inline positional
    kernels give, output and every gradient (the parameters' from the table's derivative
    slots), to the float32 floor of tests/tolerance.py (ATOL, atol_for: 1e-5 of max(1, the
    result's largest value), a parameter's gradient being a sum over every score); the float64
    reference holds both
    (test_random_integer_positions_...). Sandwich's inline kernels sum 64 float32 cosines a
    score, whose last bits follow the CPU's vector code: on an AVX-512 machine its scale's
    gradient (up to 74) came 8.3e-5 from float64 inline and 4.1e-5 from the table (naive float32
    torch: 3.1e-5), 1.2e-4 apart, where an elementwise 2e-5 had held on the machine before."""
    run = _randomized_positions_call(name, causal, per_head, shift, "triton", seed=23)
    spans = _spy_position_calls(monkeypatch)
    table = run()
    assert len(spans) == 1 and spans[0] is not None, spans   # decided once, forward and backward
    _force_inline(monkeypatch)
    inline = run()
    for i, (a, b) in enumerate(zip(table, inline)):
        assert bool(torch.isfinite(a).all()), i
        torch.testing.assert_close(a, b, rtol=0, atol=atol_for(torch.float32, b),
                                   msg=lambda m: f"output {i}: {m}")


def _count_host_reads(monkeypatch) -> dict:
    """Count the ways host code reads a tensor's values (each waits for the queue on a GPU)."""
    counts = dict.fromkeys(("tolist", "item", "__int__", "__float__", "__bool__"), 0)
    for name in counts:
        real = getattr(torch.Tensor, name)

        def spy(self, *args, name=name, real=real):
            counts[name] += 1
            return real(self, *args)
        monkeypatch.setattr(torch.Tensor, name, spy)
    return counts


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_positions_through_a_table_prior_are_read_once_a_training_step(dtype, monkeypatch):
    """On a GPU every host read of a tensor waits for the queue. A call at integer positions
    read them six times over a forward and its backward: the range check's bounds of pos_q
    and pos_k (four scalars, one read each), the table's choice in the forward, and again in
    the backward. Now the range check reads both tensors' bounds at once, the table's choice
    takes them from it (Positions.extent), and the backward takes the forward's choice: one
    read a step; float positions, which the choice reads itself, one too. The table is still
    read, and the result is the inline kernels'."""
    g = torch.Generator().manual_seed(8)
    leaves = [torch.randn(2, 2, 21, 16, generator=g).requires_grad_() for _ in range(3)]
    pos = torch.sort(torch.randperm(60, generator=g)[:21]).values.expand(2, 21).to(dtype)
    layer = GGD.GeneralizedGaussianAttention(2, init=dict(alpha=[3.0, 9.0]))

    def step():
        out = layer(*leaves, pos_q=pos, pos_k=pos, backend="triton")
        return (out, *torch.autograd.grad(out.square().sum(), leaves + list(layer.parameters())))
    spans = _spy_position_calls(monkeypatch)
    counts = _count_host_reads(monkeypatch)
    got = step()
    assert sum(counts.values()) == 1, counts
    assert len(spans) == 1 and spans[0] is not None, spans
    monkeypatch.undo()
    _force_inline(monkeypatch)
    want = step()
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=0, atol=atol_for(torch.float32, b),
                                   msg=lambda m: f"output {i}: {m}")


def test_integer_positions_that_want_gradients_or_spread_far_are_computed_inline(monkeypatch):
    """The table serves integer positions that take no gradient: float positions that require
    one (even at integer values), fractional ones, and ones spread over more than
    POSITION_TABLE_SPAN x (Nq + Nk) distances take the inline kernels, and a prior without a
    table (ALiBi's ramp is inline) or over several channels never reads one."""
    from bamgen.runtime.constants import POSITION_TABLE_SPAN
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=g) for _ in range(3))
    near = torch.arange(20.0)[None]
    spans = _spy_position_calls(monkeypatch)

    def call(module, pos, **params):
        return module.attention(q, k, v, **params, pos_q=pos, pos_k=pos, backend="triton")

    call(GGD, near.long(), alpha=4.0, beta=1.0, mu=0.0)
    call(GGD, near + 0.5, alpha=4.0, beta=1.0, mu=0.0)
    call(GGD, near * (2 * POSITION_TABLE_SPAN + 1), alpha=4.0, beta=1.0, mu=0.0)
    wants = near.clone().requires_grad_()
    out = call(GGD, wants, alpha=4.0, beta=1.0, mu=0.0)
    (grad,) = torch.autograd.grad(out.sum(), wants)
    assert bool(torch.isfinite(grad).all())
    laplace = importlib.import_module("generated.laplace")
    call(laplace, near.long(), b=2.0)
    assert spans[0] is not None and spans[1:] == [None] * 4, spans   # (one a call)
    assert GGD._prior.position_table is not None
    for module in (laplace, ALIBI_2D, FOX, importlib.import_module("generated.t5"),
                   importlib.import_module("generated.bam_ssmax")):
        assert module._prior.position_table is None, module.__name__


def test_packed_documents_read_the_table_at_their_integer_positions(monkeypatch):
    """Packed documents (cu_seqlens) of 5, 17 and 9 tokens, each at random integer positions of
    its own, through GGD on the Triton kernels' table: the same output and gradients as each
    document alone."""
    g = torch.Generator().manual_seed(31)
    cu = torch.tensor([0, 5, 22, 31], dtype=torch.int32)
    H, D = 2, 16
    q, k, v, dout = (torch.randn(1, H, 31, D, generator=g) for _ in range(4))
    spans = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    pos = torch.cat([torch.sort(torch.randperm(4 * (b - a), generator=g)[:b - a]).values
                     for a, b in spans])[None]
    params = dict(alpha=torch.tensor([3.0, 9.0]), beta=torch.tensor([1.0, 1.7]),
                  mu=torch.tensor([0.0, 2.0]))
    seen = _spy_position_calls(monkeypatch)

    def run(packed):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        p = {n: t.clone().requires_grad_() for n, t in params.items()}
        if packed:
            out = GGD.attention(*leaves, **p, causal=True, pos_q=pos, pos_k=pos, cu_seqlens_q=cu,
                                cu_seqlens_k=cu, backend="triton")
        else:
            out = torch.cat([GGD.attention(*(t[:, :, a:b] for t in leaves), **p, causal=True,
                                           pos_q=pos[:, a:b], pos_k=pos[:, a:b], backend="triton")
                             for a, b in spans], 2)
        return (out, *torch.autograd.grad(out, leaves + list(p.values()), dout))

    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert len(seen) == 4 and None not in seen, seen


def test_integer_positions_read_the_table_under_a_fullgraph_compile(monkeypatch):
    """torch.compile(fullgraph=True, dynamic=True) over GGD with integer positions: the
    positional custom ops take the table too (no position gradient is wanted), one graph for
    two lengths, output and gradients equal to eager's."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    seen = _spy_position_calls(monkeypatch)
    alpha = torch.tensor([3.0, 9.0], requires_grad=True)

    def step(q, k, v, pos):
        return GGD.attention(q, k, v, alpha=alpha, beta=1.5, mu=0.0, causal=True, pos_q=pos,
                             pos_k=pos, backend="triton")
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    g = torch.Generator().manual_seed(3)
    for n in (19, 40):
        leaves = [torch.randn(1, 2, n, 16, generator=g).requires_grad_() for _ in range(3)]
        pos = torch.sort(torch.randperm(3 * n, generator=g)[:n]).values[None]
        results = []
        for fn in (compiled, step):
            out = fn(*leaves, pos)
            results.append((out, *torch.autograd.grad(out.square().sum(), leaves + [alpha])))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want)
    # the compiled ops decide in the forward's and the backward's, eager once a call
    assert len(seen) == 6 and None not in seen, seen
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    torch._dynamo.reset()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_range,k_range", [((150, 400), (0, 200)), ((300, 330), (0, 60))],
                         ids=["overlapping", "apart"])
def test_cross_attention_at_unsorted_integer_positions_reads_the_table(q_range, k_range, causal,
                                                                        monkeypatch):
    """Cross-attention (Nq = 23, Nk = 41, GQA, a key_mask) at integer positions drawn per batch
    row and per head, unsorted and with repeats, queries and keys from ranges of their own
    (overlapping, or apart): distances reach past the table's 256 entries of padding either
    side, so every entry the kernels read must be the right one. The table kernels give the
    inline kernels' output and every gradient."""
    g = torch.Generator().manual_seed(41)
    B, H, Hk, Nq, Nk, D = 2, 4, 2, 23, 41, 16
    q, dout = (torch.randn(B, H, Nq, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, Hk, Nk, D, generator=g) for _ in range(2))
    pos_q = torch.randint(*q_range, (B, H, Nq), generator=g)
    pos_k = torch.randint(*k_range, (B, H, Nk), generator=g)
    key_mask = torch.ones(B, Nk, dtype=torch.bool)
    key_mask[0, -6:] = False
    params = dict(alpha=torch.tensor([30.0, 90.0, 200.0, 50.0]),
                  beta=torch.tensor([1.0, 1.5, 2.0, 0.7]), mu=torch.tensor([0.0, 20.0, -5.0, 150.0]))

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        p = {n: t.clone().requires_grad_() for n, t in params.items()}
        out = GGD.attention(*leaves, **p, causal=causal, pos_q=pos_q, pos_k=pos_k,
                            key_mask=key_mask, backend="triton")
        return [out, *torch.autograd.grad(out, leaves + list(p.values()), dout)]

    spans = _spy_position_calls(monkeypatch)
    table = run()
    assert len(spans) == 1 and spans[0] is not None, spans
    assert max(-spans[0][0], spans[0][1]) > 256, spans   # past the padding of a (0, 0) span
    _force_inline(monkeypatch)
    for i, (a, b) in enumerate(zip(table, run())):
        assert bool(torch.isfinite(a).all()), i
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5, msg=lambda m: f"output {i}: {m}")


# A non-finite position (docs/positions.md, "Non-finite positions"): which gradients it reaches
NON_FINITE = {   # prior: (module, log-prior, kink, its parameters per head [Hq], increasing positions)
    "forget_gate": (FOX, lambda d, p: d, None, {},
                    lambda g, n: torch.nn.functional.logsigmoid(torch.randn(1, 2, n, generator=g) + 2).cumsum(-1)),
    "laplace": (importlib.import_module("generated.laplace"), lambda d, p: -torch.abs(d) / p["b"],
                lambda d, p: d == 0, {"b": [2.0, 5.0]},
                lambda g, n: (0.5 + torch.rand(1, 2, n, generator=g)).cumsum(-1)),
}


def _rule_reference(q, k, v, dout, pos_q, pos_k, params, log_prior, kink, compute_dtype):
    """The float64 reference (tests/reference.py) under the rule for a row that a NaN reached:
    its output, dq and dpos_q are non-finite (NaN here), it gives NaN to the dk, dv and dpos_k of
    the keys whose logit it has as NaN or +inf and to its head's parameters, and nothing to any
    other key. Each (head, row) is its own reference call (q_offset places it for the causal
    mask), so a finite row's share is autograd's and a poisoned row's shares are left out.
    Returns {name: (value, gross)} for out, dq, dk, dv, dpos_q, dpos_k and d<param>."""
    B, Hq, N, D = q.shape
    G = Hq // k.shape[1]
    res = {"out": q.new_zeros(B, Hq, N, D), "dq": q.new_zeros(B, Hq, N, D), "dk": k.new_zeros(k.shape),
           "dv": v.new_zeros(v.shape), "dpos_q": q.new_zeros(B, Hq, N), "dpos_k": q.new_zeros(B, Hq, N),
           **{"d" + n: q.new_zeros(Hq) for n in params}}
    res = {name: t.double() for name, t in res.items()}
    gross = {name: torch.zeros_like(t) for name, t in res.items()}
    for h in range(Hq):
        kv = slice(h // G, h // G + 1)
        # where a row's shares of the keys and parameters land: its KV head's keys, its head's
        slot = {"dk": (slice(None), kv), "dv": (slice(None), kv), "dpos_k": (slice(None), h),
                **{"d" + n: (h,) for n in params}}
        theta = {n: vals[h] for n, vals in params.items()}
        for i in range(N):
            r = reference_attention(q[:, h:h + 1, i:i + 1], k[:, kv], v[:, kv], theta, log_prior,
                                    causal=True, q_offset=i, kink=kink,
                                    dout=dout[:, h:h + 1, i:i + 1], compute_dtype=compute_dtype,
                                    positions=(pos_q[:, h:h + 1, i:i + 1], pos_k[:, h:h + 1]))
            res["out"][:, h, i] = r.out[:, 0, 0]
            if bool(torch.isfinite(r.out).all()):
                res["dq"][:, h, i], res["dpos_q"][:, h, i] = r.dq[:, 0, 0], r.dpos_q[:, 0, 0]
                shares = {"dk": r.dk, "dv": r.dv, "dpos_k": r.dpos_k,
                          **{"d" + n: g for n, g in r.dparams.items()}}
                for name, share in shares.items():
                    res[name][slot[name]] += share.double().reshape(res[name][slot[name]].shape)
                for name, g in r.gross.items():   # (float64 only: the terms' sizes)
                    at = (slice(None), h, i) if name == "dq" else slot.get(name)
                    if name != "out" and at is not None:
                        gross[name][at] += g.reshape(gross[name][at].shape)
                continue
            d = pos_q[:, h, i, None].double() - pos_k[:, h].double()
            logit = log_prior(d, {n: torch.tensor(val, dtype=torch.float64) for n, val in theta.items()})
            hit = ((torch.isnan(logit) | (logit == float("inf"))) & (torch.arange(N) <= i))[0]
            res["dq"][:, h, i] = res["dpos_q"][:, h, i] = float("nan")
            res["dk"][:, kv, hit] = res["dv"][:, kv, hit] = float("nan")
            res["dpos_k"][:, h, hit] = float("nan")
            for n in params:
                res["d" + n][h] = float("nan")
    return {name: (t, gross[name]) for name, t in res.items()}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("where", ["pos_q", "pos_k", "both"])
@pytest.mark.parametrize("fill", [float("nan"), float("-inf")], ids=["nan", "-inf"])
@pytest.mark.parametrize("name", sorted(NON_FINITE))
def test_a_non_finite_position_reaches_the_gradients_the_rule_says(name, fill, where, backend):
    """One NaN or -inf position (head 0, token 5 of 12; GQA) against the float64 reference under
    docs/positions.md's rule: a -inf log-prior hides its key (Laplace's key at -inf: weight 0,
    no gradient, b's gradient finite), a row that sees no other key sees nothing (0), and a row
    whose logit is NaN or +inf (FoX's key at -inf: d = +inf; -inf - -inf) is NaN in its output,
    dq and dpos_q and poisons exactly the keys that poisoned it and its head's parameters. Both
    backends give the same finite set, and the finite values within float32's tolerance."""
    module, log_prior, kink, params, positions = NON_FINITE[name]
    g = torch.Generator().manual_seed(12)
    B, Hq, Hk, N, D, t = 1, 2, 1, 12, 16, 5
    q, dout = (torch.randn(B, Hq, N, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, Hk, N, D, generator=g) for _ in range(2))
    pos_q, pos_k = positions(g, N), positions(g, N)
    if where in ("pos_q", "both"):
        pos_q[0, 0, t] = fill
    if where in ("pos_k", "both"):
        pos_k[0, 0, t] = fill
    leaves = [x.clone().requires_grad_() for x in (q, k, v, pos_q, pos_k)]
    p_leaves = {n: torch.tensor(vals, requires_grad=True) for n, vals in params.items()}
    out = module.attention(*leaves[:3], **p_leaves, causal=True, pos_q=leaves[3], pos_k=leaves[4],
                           backend=backend)
    grads = torch.autograd.grad(out, leaves + list(p_leaves.values()), dout)
    got = dict(zip(["out", "dq", "dk", "dv", "dpos_q", "dpos_k", *("d" + n for n in params)],
                   (out, *grads)))
    ref = _rule_reference(q, k, v, dout, pos_q, pos_k, params, log_prior, kink, torch.float64)
    pt = _rule_reference(q, k, v, dout, pos_q, pos_k, params, log_prior, kink, torch.float32)
    results = []
    for key, mine in got.items():
        want, gross = ref[key]
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(mine), finite), (key, mine, want)
        results.append((key, torch.where(finite, mine.double(), 0.0), torch.where(finite, want, 0.0),
                        torch.where(finite, pt[key][0], 0.0), gross))
    assert bool(torch.isfinite(got["out"][0, 1]).all()) and bool(torch.isfinite(got["dq"][0, 1]).all())
    assert_all_close(results, torch.float32, context=f"{name} {where} = {fill}, {backend}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_key_at_minus_infinity_among_integer_positions_is_a_hidden_key(backend):
    """Laplace at integer positions, key 3's at -inf: that key is hidden (weight 0), so the call
    equals the one whose key_mask hides it, with every gradient. The CPU path's choice of a
    distance table read int(inf) of such positions and raised OverflowError."""
    laplace = NON_FINITE["laplace"][0]
    g = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(1, 2, 9, 16, generator=g) for _ in range(4))
    results = []
    for hidden in ("position", "key_mask"):
        pos_k = torch.arange(9.0)[None].clone()
        key_mask = torch.ones(1, 9, dtype=torch.bool)
        if hidden == "position":
            pos_k[0, 3] = float("-inf")
        else:
            key_mask[0, 3] = False
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        b = torch.tensor([2.0, 3.0], requires_grad=True)
        out = laplace.attention(*leaves, b=b, causal=True, pos_q=torch.arange(9.0)[None], pos_k=pos_k,
                                key_mask=key_mask, backend=backend)
        results.append((out, *torch.autograd.grad(out, leaves + [b], dout)))
    for name, got, want in zip(("out", "dq", "dk", "dv", "db"), *results):
        assert bool(torch.isfinite(got).all()), name
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)


# A prior of one's own over several channels that reads n (the keys a row sees): its slope in
# the grid distance grows with log(n), and c log(n) moves every logit of a row alike (softmax is
# blind to it: c's gradient is 0). Its dQ kernel measures the derivatives from each row's own
# position (center_grads), which over several channels reads one d = 0 per channel.
GRID_N = """
    name: grid_n{C}
    positions: {C}
    log_prior: -({distance}) * log(n) / b + c * log(n)
    params:
      b: {{init: 2.0, domain: positive}}
      c: {{init: 0.3}}
    """


@pytest.fixture(scope="module")
def grid_n_priors(tmp_path_factory):
    """The 2- and 3-channel priors of GRID_N, built once from their own files."""
    folder = tmp_path_factory.mktemp("grid_n")
    built = {}
    for channels in (2, 3):
        distance = " + ".join(f"Abs(d{c})" for c in range(channels))
        text = GRID_N.format(C=channels, distance=distance)
        built[channels] = bamgen.load(write_prior(folder, text, f"grid_n{channels}.yaml"),
                                      cache_dir=folder / "cache")
    return built


@pytest.mark.parametrize("backend,dtype", PATHS)
@pytest.mark.parametrize("channels,grid", [(2, (4, 6)), (3, (2, 3, 4))])
def test_a_prior_of_ones_own_over_several_channels_reading_n(grid_n_priors, channels, grid,
                                                             backend, dtype):
    """Every value and gradient (q, k, v, the positions through a learnt shift, b, c) against
    the float64 attention with the bias written out, causal with padding keys so that n is not
    the row's index plus one. The Triton backward of such a prior raised TypeError: its dQ
    kernel took each row's d = 0 as one tensor where the positions are one per channel."""
    module = grid_n_priors[channels]
    assert module.TRAITS.center_grads
    g = torch.Generator().manual_seed(channels)
    B, H, N = 2, 2, 24
    shift = torch.randn(B, N, channels, generator=g, dtype=dtype).mul(0.3).requires_grad_(True)
    pos = bamgen.positions.grid(*grid, dtype=dtype)[None] + shift
    q, k, v = (torch.randn(B, H, N, 16, generator=g, dtype=dtype, requires_grad=True) for _ in range(3))
    key_mask = torch.ones(B, N, dtype=torch.bool)
    key_mask[0, [3, 10]] = False
    key_mask[1, 17:] = False
    b = torch.tensor([1.5, 3.0], requires_grad=True)
    c = torch.tensor([0.3, -0.2], requires_grad=True)
    out = module.attention(q, k, v, b=b, c=c, causal=True, key_mask=key_mask, pos_q=pos, pos_k=pos,
                           backend=backend)

    def build(cdt):
        visible = torch.ones(N, N, dtype=torch.bool).tril() & key_mask[:, None, :]
        log_n = visible.sum(-1).to(cdt).log()[:, None, :, None]     # every row sees key 0
        p = pos.to(cdt)
        dist = (p[:, :, None, :] - p[:, None, :, :]).abs().sum(-1)[:, None]
        bias = -dist * log_n / b.to(cdt)[None, :, None, None] + c.to(cdt)[None, :, None, None] * log_n
        return _materialised(q, k, v, bias, True, key_mask=key_mask, cdt=cdt)
    _check(out, build, dtype, (q, k, v, shift, b, c), torch.randn(out.shape, generator=g))

