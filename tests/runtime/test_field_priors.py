"""The field's priors as a user brings them: T5's buckets, FIRE's MLP and Sandwich's cosines
(vector parameters, Sum, let), against their papers' own code paths and the float64 reference,
on the CPU path and the Triton kernels (interpreted). The library's reference check of every
shipped prior is tests/runtime/test_library.py; this file holds what is particular to vectors:
the buckets at every distance, the bucket boundaries, the shapes a user passes, random inits,
run-to-run determinism, padding positions and composition with masks, decode, the block API
and the nn.Module."""
import math

import pytest
import torch
from transformers.models.t5.modeling_t5 import T5Attention

import bamgen
import generated.fire as fire
import generated.sandwich as sandwich
import generated.t5 as t5
import generated.t5_bidirectional as t5_bidirectional
from tests.reference import reference_attention
from tests.runtime.test_library import LIBRARY
from tests.tolerance import assert_all_close

BACKENDS = ["torch", "triton"]


def _buckets(d, bidirectional):
    """transformers' own T5 bucket of every distance d = i - j (relative position j - i)."""
    return T5Attention._relative_position_bucket(-d, bidirectional=bidirectional, num_buckets=32,
                                                 max_distance=128)


@pytest.mark.parametrize("module, bidirectional", [(t5, False), (t5_bidirectional, True)],
                         ids=["t5", "t5_bidirectional"])
def test_t5_buckets_are_transformers_own_at_every_distance(module, bidirectional):
    """With w[k] = k the log-prior is the bucket itself: every distance to 4096 (both signs for
    the encoder's buckets) lands in transformers' bucket, bucket boundaries included."""
    d = torch.arange(-4096 if bidirectional else 0, 4097)
    got = module.log_prior_at(d, w=torch.arange(32, dtype=torch.float64)[None].expand(3, 32))
    want = _buckets(d, bidirectional).to(torch.float64)
    assert got.shape == (3, d.numel())
    assert torch.equal(got[0], want) and torch.equal(got[2], want)
    assert int(got.max()) == 31 and int(got.min()) == 0


def _t5_params(heads, seed=3):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(heads, 32, generator=g)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("module, bidirectional, q_offset, Nk", [
    (t5, False, 140, 145),              # causal distances 0 .. 144: 15 | 16, 127 | 128 | 129
    (t5, False, 3990, 24),              # far keys only: every one in the last bucket
    (t5_bidirectional, True, 131, 9),   # 123 .. 139 behind: the encoder's 127 | 128 boundary
    (t5_bidirectional, True, 5, 21),    # 10 behind to 15 ahead: 7 | 8 | 9 on both sides
], ids=["causal-16-128", "causal-far", "encoder-128", "encoder-8"])
def test_t5_at_bucket_boundaries(module, bidirectional, q_offset, Nk, backend):
    """Outputs and every gradient (the 32 buckets' included) where the distances straddle the
    bucket boundaries, against the reference with transformers' buckets."""
    log_prior = LIBRARY[module.PRIOR["name"]][0]
    torch.manual_seed(5)
    B, Hq, Hk, Nq, D = 1, 2, 1, 6, 16
    q, k, v = torch.randn(B, Hq, Nq, D), torch.randn(B, Hk, Nk, D), torch.randn(B, Hk, Nk, D)
    dout = torch.randn(B, Hq, Nq, D)
    params = _t5_params(Hq)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, params["w"])]
    causal = not bidirectional
    out = module.attention(*leaves[:3], w=leaves[3], causal=causal, q_offset=q_offset,
                           backend=backend)
    grads = torch.autograd.grad(out, leaves, dout)
    kw = dict(causal=causal, q_offset=q_offset, dout=dout)
    ref = reference_attention(q, k, v, params, log_prior, **kw)
    pt = reference_attention(q, k, v, params, log_prior, compute_dtype=torch.float32, **kw)
    assert_all_close([("out", out, ref.out, pt.out), ("dq", grads[0], ref.dq, pt.dq),
                      ("dk", grads[1], ref.dk, pt.dk), ("dv", grads[2], ref.dv, pt.dv),
                      ("dw", grads[3], ref.dparams["w"], pt.dparams["w"])], torch.float32,
                     context=f"{module.PRIOR['name']} {backend}")
    # the buckets no key reaches get exactly no gradient
    d = (torch.arange(Nq)[:, None] + q_offset) - torch.arange(Nk)[None, :]
    seen = set(_buckets(d[d >= 0] if causal else d, bidirectional).flatten().tolist())
    unseen = [b for b in range(32) if b not in seen]
    assert torch.all(grads[3][:, unseen] == 0)


def _fire_params(heads, seed=7):
    g = torch.Generator().manual_seed(seed)
    return {"c": torch.tensor(0.3), "L": torch.tensor(8.0),
            "w1": torch.rand(32, generator=g) * 2 - 1, "b1": torch.rand(32, generator=g) * 2 - 1,
            "w2": (torch.rand(heads, 32, generator=g) * 2 - 1) / math.sqrt(32),
            "b2": torch.rand(heads, generator=g) - 0.5}


CASES = {
    "t5": (t5, _t5_params),
    "fire": (fire, _fire_params),
    "sandwich": (sandwich, lambda heads: {"a": torch.linspace(0.01, 0.2, heads)}),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_are_bit_identical_run_to_run(name, backend):
    """Twice the same call, every gradient equal bit for bit (no atomics: one partial sum per
    program, summed in a fixed order; the CPU path's threads each own their rows)."""
    module, make = CASES[name]
    torch.manual_seed(2)
    # (FIRE's gradients take a dQ launch per 16 scalars under the interpreter, each a full pass
    # of it: a smaller batch keeps its two runs short; still several query and key tiles, ragged)
    batch, heads, n = (1, 2, 29) if name == "fire" else (2, 4, 37)
    q, k, v = (torch.randn(batch, heads, n, 16) for _ in range(3))
    params = make(heads)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        p = {n: t.clone().requires_grad_(n in module.LEARNABLE) for n, t in params.items()}
        out = module.attention(*leaves, **p, causal=True, backend=backend)
        runs.append(torch.autograd.grad(out.square().sum(), leaves + [p[n] for n in module.LEARNABLE]))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def _fractional_buckets(d, bidirectional):
    """transformers' T5 buckets (_relative_position_bucket) computed at fractional distances
    d = i - j, the bucket being the floor of what its formula gives: a small distance's own
    floor, a large one's truncated logarithm."""
    relative = -d   # j - i
    buckets, exact, count = torch.zeros_like(d), 16.0, 32
    if bidirectional:
        count, exact = 16, 8.0
        buckets = (relative > 0).to(d.dtype) * 16
        relative = relative.abs()
    else:
        relative = -torch.clamp(relative, max=0.0)
    large = exact + torch.log(relative / exact) / math.log(128 / exact) * (count - exact)
    large = torch.clamp(large.floor(), max=count - 1)
    return (buckets + torch.where(relative < exact, relative.floor(), large)).long()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("module", [t5, t5_bidirectional], ids=["t5", "t5_bidirectional"])
def test_a_bucket_read_at_fractional_positions_takes_its_gradient(module, backend):
    """T5's buckets over float positions (docs/positions.md): a fractional distance reads the
    element at its index's floor, and its gradient went nowhere (d w[k] was 1 where the index
    equalled k, which a fractional index never does: dw of bucket 2 came out 0 where finite
    differences of the forward give 0.031). Against autograd of a float64 reference reading the
    same buckets, output and dw, at positions whose distances fall between integers."""
    g = torch.Generator().manual_seed(5)
    B, H, N, D = 1, 2, 9, 8
    q, k, v, dout = (torch.randn(B, H, N, D, generator=g) for _ in range(4))
    pos = torch.tensor([[0.0, 18.6, 2.5, 40.3, 20.7, 57.1, 3.25, 9.9, 130.4]])
    w = torch.randn(H, 32, generator=g) * 0.5
    d = pos[0, :, None].double() - pos[0, None, :].double()
    index = _fractional_buckets(d, module is t5_bidirectional)
    assert torch.equal(_fractional_buckets(d.round(), module is t5_bidirectional),
                       _buckets(d.round().long(), module is t5_bidirectional))
    w64 = w.double().requires_grad_()
    bias = w64[:, index]
    mask = torch.ones(N, N, dtype=torch.bool).tril() if module is t5 else torch.ones(N, N, dtype=torch.bool)
    logits = (q.double() @ k.double().transpose(-1, -2)) / D ** 0.5 + bias
    want = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1) @ v.double()
    (want_dw,) = torch.autograd.grad(want, w64, dout.double())
    w32 = w.clone().requires_grad_()
    out = module.attention(q, k, v, w=w32, causal=module is t5, pos_q=pos, pos_k=pos,
                           backend=backend)
    (dw,) = torch.autograd.grad(out, w32, dout)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(dw.double(), want_dw, rtol=0, atol=1e-5)


def test_vectors_take_the_shapes_a_user_has():
    """A per-head vector [Hq, size] or [size] (the same for every head; [1, size] too); a
    shared vector [size]; a shared scalar a float or a 0-d tensor; gradients come back in the
    shapes given."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 9, 8, dtype=torch.float64)
    w = torch.randn(32, dtype=torch.float64)
    per_head = t5.attention(q, q, q, w=w[None].expand(4, 32))
    assert torch.equal(t5.attention(q, q, q, w=w), per_head)
    assert torch.equal(t5.attention(q, q, q, w=w[None]), per_head)
    p = {n: t.double() for n, t in _fire_params(4).items()}
    base = fire.attention(q, q, q, **p)
    as_floats = {"c": p["c"].item(), "L": p["L"].item()}
    assert torch.equal(fire.attention(q, q, q, **{**p, **as_floats}), base)
    leaves = {n: t.clone().requires_grad_() for n, t in p.items()}
    grads = torch.autograd.grad(fire.attention(q, q, q, **leaves).sum(), list(leaves.values()))
    assert [g.shape for g in grads] == [t.shape for t in p.values()]


@pytest.mark.parametrize("value, words", [
    (torch.zeros(4, 31), r"w must be a tensor of shape \[4, 32\] \(a row per query head\) or "
                         r"\[32\], got shape \(4, 31\)"),
    (torch.zeros(3, 32), r"got shape \(3, 32\)"),
    (0.5, r"w must be a tensor of shape \[4, 32\].*got 0.5, one number \(a vector of 32 "
          r"elements: e.g. torch.full\(\(32,\), x\)"),
    (torch.zeros(4, 32, dtype=torch.int64), "floating-point"),
])
def test_a_vector_of_the_wrong_shape_is_named(value, words):
    q = torch.randn(1, 4, 5, 8)
    with pytest.raises(ValueError, match=words):
        t5.attention(q, q, q, w=value)


def test_a_shared_vector_of_the_wrong_shape_is_named():
    q = torch.randn(1, 4, 5, 8)
    p = _fire_params(4)
    with pytest.raises(ValueError, match=r"w1 must be a tensor of shape \[32\] \(shared by the "
                                         r"heads\), got shape \(4, 31\)"):
        fire.attention(q, q, q, **{**p, "w1": torch.zeros(4, 31)})
    # a row per head for a vector the heads share would let them silently differ
    with pytest.raises(ValueError, match=r"w1 must be a tensor of shape \[32\] \(shared by "
                                         r"the heads\), got shape \(4, 32\)"):
        fire.attention(q, q, q, **{**p, "w1": torch.zeros(4, 32)})
    with pytest.raises(ValueError, match=r"w1 must be a tensor of shape \[32\]"):
        fire.FireAttention(num_heads=4, init={"w1": torch.zeros(4, 32)})
    assert fire.attention(q, q, q, **{**p, "w1": p["w1"][None]}).shape == q.shape   # [1, size]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shared_scalar_given_a_value_per_head_is_named(backend):
    """FIRE's c and L are shared by the heads (per_head: false). Given [Hq] (default_params'
    shape) they are taken when every head holds the same value; different values per head were
    taken too, each head silently using its own. Refused by name, in the domain test's read."""
    q = torch.randn(1, 4, 5, 8)
    p = _fire_params(4)
    base = fire.attention(q, q, q, **p, backend=backend)
    same = fire.attention(q, q, q, **{**p, "c": torch.full((4,), 0.3)}, backend=backend)
    assert torch.equal(same, base)
    assert fire.attention(q, q, q, **fire.default_params(4), backend=backend).shape == q.shape
    with pytest.raises(ValueError, match=r"c is shared by the heads \(per_head: false in the "
                                         r"prior file\): pass a float or a 0-d tensor, got a "
                                         r"different value per head \(0.1, 0.9, 0.9, 0.9\)"):
        fire.attention(q, q, q, **{**p, "c": torch.tensor([0.1, 0.9, 0.9, 0.9])}, backend=backend)
    with pytest.raises(ValueError, match=r"L must be positive"):   # the domain's message first
        fire.attention(q, q, q, **{**p, "L": torch.tensor([8.0, -1.0, 8.0, 8.0])}, backend=backend)


def test_an_infinite_index_is_clamped_like_any_other(tmp_path):
    """log2 buckets: at d = 0 the index formula is -inf, which clamps to w[0] (it built with
    Max(0, ...) around it, and must build without); a random init written as 2e-2 (which YAML
    reads as a string) is a number."""
    (tmp_path / "log_buckets.yaml").write_text(
        "name: log_buckets\n"
        "params:\n  w: {size: 8, init: {normal: [0, 2e-2]}}\n"
        "log_prior: w[Min(7, floor(log(Abs(d))/log(2)))]\n")
    module = bamgen.load(tmp_path / "log_buckets.yaml", cache_dir=tmp_path / "cache")
    d = torch.tensor([0, 1, 2, 3, 4, 7, 8, 200, -5])
    got = module.log_prior_at(d, w=torch.arange(8.0, dtype=torch.float64)[None].expand(2, 8))
    assert got[0].tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 7.0, 2.0]


def test_the_module_stores_vectors_and_draws_random_inits_from_torch():
    """default_params draws from torch's generator (a seed repeats it), one draw for a value the
    heads share; the nn.Module stores [H, size] per head and [size] shared, and its state dict
    loads into another."""
    torch.manual_seed(4)
    a = fire.FireAttention(num_heads=3)
    torch.manual_seed(4)
    b = fire.FireAttention(num_heads=3)
    c = fire.FireAttention(num_heads=3)
    shapes = {n: tuple(t.shape) for n, t in a.prior_params().items()}
    assert shapes == {"c": (1,), "L": (1,), "w1": (32,), "b1": (32,), "w2": (3, 32), "b2": (3,)}
    for n in a.prior_params():
        assert torch.equal(a.prior_params()[n], b.prior_params()[n])
    assert not torch.equal(a.prior_params()["w2"], c.prior_params()["w2"])
    bound = 1 / math.sqrt(32)
    assert float(a.prior_params()["w2"].detach().abs().max()) <= bound
    assert torch.allclose(a.prior_params()["c"], torch.tensor([0.1]))
    c.load_state_dict(a.state_dict())
    q = torch.randn(1, 3, 11, 8)
    assert torch.equal(a(q, q, q), c(q, q, q))
    assert set(a.state_dict()) == {"raw_c", "raw_L", "raw_w1", "raw_b1", "raw_w2", "raw_b2"}
    # an explicit init, in the shapes of attention()
    d = t5.T5Attention(num_heads=2, init={"w": torch.arange(32.0)})
    assert torch.equal(d.prior_params()["w"], torch.arange(32.0)[None].expand(2, 32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_positions_never_reach_the_formula(backend):
    """FIRE reads the query's position i: in a left-padded batch (q_offset = k_offset = -pad,
    key_mask) a padding row's position is negative, and without the causal mask it sees the
    real keys. The runtime reads every negative position as 0 (so log(c * max(i, L) + 1) stays
    a number): every output and gradient is finite and matches the reference that does the same,
    the real rows exactly those of each sequence alone."""
    torch.manual_seed(8)
    B, H, N, D = 2, 2, 13, 16
    pads = torch.tensor([0, 5])
    q, k, v, dout = (torch.randn(B, H, N, D) for _ in range(4))
    key_mask = torch.arange(N)[None, :] >= pads[:, None]
    params = _fire_params(H)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    p = {n: t.clone().requires_grad_() for n, t in params.items()}
    out = fire.attention(*leaves, **p, causal=False, q_offset=-pads, k_offset=-pads,
                         key_mask=key_mask, backend=backend)
    grads = torch.autograd.grad(out, leaves + list(p.values()), dout)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    ref_params = {n: t[None] if n in ("w1", "b1") else t for n, t in params.items()}
    kw = dict(causal=False, q_offset=-pads, k_offset=-pads, key_mask=key_mask, dout=dout,
              clamp_positions=True)
    ref = reference_attention(q, k, v, ref_params, LIBRARY["fire"][0], **kw)
    pt = reference_attention(q, k, v, ref_params, LIBRARY["fire"][0], compute_dtype=torch.float32, **kw)
    shared = {"c", "L", "w1", "b1"}
    results = [("out", out, ref.out, pt.out), ("dq", grads[0], ref.dq, pt.dq),
               ("dk", grads[1], ref.dk, pt.dk), ("dv", grads[2], ref.dv, pt.dv)]
    for (n, _), g in zip(params.items(), grads[3:]):
        r, t = (ref.dparams[n].sum(0), pt.dparams[n].sum(0)) if n in shared else (ref.dparams[n], pt.dparams[n])
        results.append((f"d{n}", g, r, t))
    assert_all_close(results, torch.float32, context=f"fire padded {backend}")
    # the second sequence's real rows are its own attention alone
    alone = fire.attention(q[1:, :, 5:], k[1:, :, 5:], v[1:, :, 5:], **params, causal=False,
                           backend=backend)
    torch.testing.assert_close(out[1:, :, 5:], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_t5_with_packed_documents_and_a_key_mask(backend):
    """Packed documents restart the positions (and so the buckets) at each document; a masked
    key takes no weight: against the reference, every gradient."""
    torch.manual_seed(9)
    cu = torch.tensor([0, 7, 29, 40], dtype=torch.int32)
    H, N, D = 2, 40, 16
    q, k, v, dout = (torch.randn(1, H, N, D) for _ in range(4))
    params = _t5_params(H)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, params["w"])]
    out = t5.attention(*leaves[:3], w=leaves[3], cu_seqlens_q=cu, cu_seqlens_k=cu, backend=backend)
    grads = torch.autograd.grad(out, leaves, dout)
    kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, dout=dout)
    ref = reference_attention(q, k, v, params, LIBRARY["t5"][0], **kw)
    pt = reference_attention(q, k, v, params, LIBRARY["t5"][0], compute_dtype=torch.float32, **kw)
    assert_all_close([("out", out, ref.out, pt.out), ("dq", grads[0], ref.dq, pt.dq),
                      ("dk", grads[1], ref.dk, pt.dk), ("dv", grads[2], ref.dv, pt.dv),
                      ("dw", grads[3], ref.dparams["w"], pt.dparams["w"])], torch.float32,
                     context=f"t5 packed {backend}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["t5", "fire"])
def test_decode_steps_equal_the_full_call(name, backend):
    """A generation loop (one query against the growing cache, q_offset = the position) gives
    the rows of one call over the whole sequence."""
    module, make = CASES[name]
    torch.manual_seed(10)
    q, k, v = (torch.randn(1, 4, 150, 16) for _ in range(3))
    params = make(4)
    full = module.attention(q, k, v, **params, causal=True, backend=backend)
    for t in (0, 17, 130, 149):
        step = module.attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], **params,
                                causal=True, q_offset=t, backend=backend)
        torch.testing.assert_close(step, full[:, :, t:t + 1], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", ["t5", "fire"])
def test_the_block_api_adds_up_to_the_call(name):
    """forward_block and backward_block over two blocks of keys, merged, give the call's output
    and gradients, the vectors' included (finish_param_grads): the ring's building blocks."""
    module, make = CASES[name]
    torch.manual_seed(11)
    q, k, v, dout = (torch.randn(1, 2, 23, 16, dtype=torch.float64) for _ in range(4))
    params = {n: t.double() for n, t in make(2).items()}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    p = {n: t.clone().requires_grad_(n in module.LEARNABLE) for n, t in params.items()}
    out = module.attention(*leaves, **p, causal=True)
    want = torch.autograd.grad(out, leaves + [p[n] for n in module.LEARNABLE], dout)
    merged, stats = module.forward_block(q, k, v, **params, causal=True)
    torch.testing.assert_close(merged, out.detach(), rtol=1e-12, atol=1e-12)
    cut = 11
    dparams, rows = None, None
    for lo, hi in ((0, cut), (cut, 23)):
        dq_b, dk_b, dv_b, dp_b, rows_b = module.backward_block(
            dout, q, k[:, :, lo:hi], v[:, :, lo:hi], merged, stats, **params, causal=True,
            k_offset=lo)
        dparams = dp_b if dparams is None else {n: dparams[n] + dp_b[n] for n in dp_b}
        rows = rows_b if rows is None else rows + rows_b
    grads = module.finish_param_grads(dparams, rows)
    for n, g in zip(module.LEARNABLE, want[3:]):
        got = grads[n] if module.TRAITS.param(n).per_head else grads[n].sum(0)
        torch.testing.assert_close(got, g, rtol=1e-9, atol=1e-9, msg=n)
