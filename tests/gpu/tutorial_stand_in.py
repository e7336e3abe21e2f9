"""A stand-in for Triton's fused-attention tutorial, shaped as benchmarks/tutorial_model.py reads
it: at import it asks Triton's driver for the target and torch for the device's capability (to
filter its autotune configs), and an autograd Function ``_attention`` launches an autotuned
forward (one config refused by a static_assert at head dim 64, as the tutorial's 128-wide
tiles are) and a fused backward with fixed warps and stages whose dK/dV loop (BLOCK_M1 x
BLOCK_N1 scores) and dQ loop (BLOCK_M2 x BLOCK_N2) take 4 and 3 matmuls a score. Each phase
first walks a masked loop the model must pass over: the forward's diagonal tile (its own tile,
more instructions), dK/dV's half tiles (BLOCK_M1 // 2 rows, as the tutorial's). Its MMA loops,
in program order: forward masked, forward; dK/dV masked, dK/dV, dQ. Not a correct attention."""
import torch
import triton
import triton.language as tl

TARGET = triton.runtime.driver.active.get_current_target()


def _hook(nargs):
    nargs["hooked"] = True


CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=3, pre_hook=_hook)
           for m, n, w in ((64, 32, 4), (64, 64, 4), (128, 128, 8), (64, 64, 8))]


def keep(config):
    # like the tutorial: drop 8 warps on small tiles, but only on Hopper
    small = config.kwargs["BLOCK_M"] * config.kwargs["BLOCK_N"] < 128 * 128
    return not (torch.cuda.get_device_capability()[0] == 9 and small and config.num_warps == 8)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K, V, sm_scale, stride_tok, stride_d, offs_m, offs_n, offs_d,
               lo, hi, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    for start in range(lo, hi, BLOCK_N):
        k = tl.load(K + (start + offs_n)[None, :] * stride_tok + offs_d[:, None] * stride_d)
        v = tl.load(V + (start + offs_n)[:, None] * stride_tok + offs_d[None, :] * stride_d)
        s = tl.dot(q, k) * sm_scale
        if MASKED:
            s = tl.where(offs_m[:, None] >= (start + offs_n)[None, :], s, -1.0e6)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(tl.float16), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=[c for c in CONFIGS if keep(c)], key=["N_CTX", "HEAD_DIM"])
@triton.jit
def _fwd(Q, K, V, Out, sm_scale, stride_tok, stride_d, N_CTX,
         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    tl.static_assert(BLOCK_N <= HEAD_DIM)
    off_hz = tl.program_id(1).to(tl.int64) * N_CTX * stride_tok
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + off_hz + offs_m[:, None] * stride_tok + offs_d[None, :] * stride_d)
    m_i = tl.zeros([BLOCK_M], tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # the diagonal tile, masked (first here, so that the model must choose the shorter loop)
    lo = tl.program_id(0) * BLOCK_M
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K + off_hz, V + off_hz, sm_scale, stride_tok,
                               stride_d, offs_m, offs_n, offs_d, lo, lo + BLOCK_M, BLOCK_N, True)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K + off_hz, V + off_hz, sm_scale, stride_tok,
                               stride_d, offs_m, offs_n, offs_d, 0, lo, BLOCK_N, False)
    out = acc / l_i[:, None]
    tl.store(Out + off_hz + offs_m[:, None] * stride_tok + offs_d[None, :] * stride_d, out.to(tl.float16))


@triton.jit
def _bwd(Q, K, V, DO, DQ, DK, DV, stride_tok, stride_d, N_CTX,
         BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr,
         BLOCK_N2: tl.constexpr, HEAD_DIM: tl.constexpr):
    off_hz = tl.program_id(1).to(tl.int64) * N_CTX * stride_tok
    offs_d = tl.arange(0, HEAD_DIM)
    # dK, dV for BLOCK_N1 keys over every query tile
    offs_n = tl.program_id(0) * BLOCK_N1 + tl.arange(0, BLOCK_N1)
    k = tl.load(K + off_hz + offs_n[:, None] * stride_tok + offs_d[None, :] * stride_d)
    v = tl.load(V + off_hz + offs_n[:, None] * stride_tok + offs_d[None, :] * stride_d)
    dk = tl.zeros([BLOCK_N1, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N1, HEAD_DIM], tl.float32)
    HALF: tl.constexpr = BLOCK_M1 // 2
    for start in range(0, BLOCK_N1, HALF):   # the diagonal, masked, in half tiles
        offs_h = tl.program_id(0) * BLOCK_N1 + start + tl.arange(0, HALF)
        qT = tl.load(Q + off_hz + offs_h[None, :] * stride_tok + offs_d[:, None] * stride_d)
        do = tl.load(DO + off_hz + offs_h[:, None] * stride_tok + offs_d[None, :] * stride_d)
        pT = tl.where(offs_h[None, :] >= offs_n[:, None], tl.math.exp2(tl.dot(k, qT)), 0.0)
        dv += tl.dot(pT.to(tl.float16), do)
        dsT = pT * tl.dot(v, tl.trans(do))
        dk += tl.dot(dsT.to(tl.float16), tl.trans(qT))
    for start in range((tl.program_id(0) + 1) * BLOCK_N1, N_CTX, BLOCK_M1):
        offs_m = start + tl.arange(0, BLOCK_M1)
        qT = tl.load(Q + off_hz + offs_m[None, :] * stride_tok + offs_d[:, None] * stride_d)
        do = tl.load(DO + off_hz + offs_m[:, None] * stride_tok + offs_d[None, :] * stride_d)
        pT = tl.math.exp2(tl.dot(k, qT))
        dv += tl.dot(pT.to(tl.float16), do)
        dsT = pT * tl.dot(v, tl.trans(do))
        dk += tl.dot(dsT.to(tl.float16), tl.trans(qT))
    tl.store(DK + off_hz + offs_n[:, None] * stride_tok + offs_d[None, :] * stride_d, dk.to(tl.float16))
    tl.store(DV + off_hz + offs_n[:, None] * stride_tok + offs_d[None, :] * stride_d, dv.to(tl.float16))
    # dQ for BLOCK_M2 queries over every key tile
    offs_m = tl.program_id(0) * BLOCK_M2 + tl.arange(0, BLOCK_M2)
    q = tl.load(Q + off_hz + offs_m[:, None] * stride_tok + offs_d[None, :] * stride_d)
    do = tl.load(DO + off_hz + offs_m[:, None] * stride_tok + offs_d[None, :] * stride_d)
    dq = tl.zeros([BLOCK_M2, HEAD_DIM], tl.float32)
    for start in range(0, N_CTX, BLOCK_N2):
        offs_k = start + tl.arange(0, BLOCK_N2)
        kT = tl.load(K + off_hz + offs_k[None, :] * stride_tok + offs_d[:, None] * stride_d)
        vT = tl.load(V + off_hz + offs_k[None, :] * stride_tok + offs_d[:, None] * stride_d)
        p = tl.math.exp2(tl.dot(q, kT))
        ds = p * tl.dot(do, vT)
        dq += tl.dot(ds.to(tl.float16), tl.trans(kT))
    tl.store(DQ + off_hz + offs_m[:, None] * stride_tok + offs_d[None, :] * stride_d, dq.to(tl.float16))


class _attention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        out = torch.empty_like(q)
        n, d = q.shape[2], q.shape[3]
        _fwd[lambda meta: (n // meta["BLOCK_M"], q.shape[0] * q.shape[1])](
            q, k, v, out, sm_scale, q.stride(2), q.stride(3), n, HEAD_DIM=d)
        ctx.save_for_backward(q, k, v, out)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        n, d = q.shape[2], q.shape[3]
        _bwd[(n // 128, q.shape[0] * q.shape[1])](
            q, k, v, do, dq, dk, dv, q.stride(2), q.stride(3), n,
            BLOCK_M1=32, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=32, HEAD_DIM=d,
            num_warps=4, num_stages=2)
        return dq, dk, dv, None, None
