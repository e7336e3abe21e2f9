"""A tiny decoder-only transformer whose attention is a bamgen-generated module.

Every variant keeps its prior parameters in the generated module (``raw_<name>`` parameters,
``prior_params()`` for their values), so the same model can run its attention two ways:

* ``backend="generated"``: the generated module's own forward and backward (the fused CPU
  path on CPU tensors, the Triton kernels on CUDA tensors), gradients of the prior parameters
  included;
* ``backend="materialised"``: the usual approach, the prior written here by hand as an
  [H, N, N] bias with autograd and passed to SDPA as ``attn_mask``. It is the baseline of the
  wall-time comparison and an independent check of the generated modules (the smoke test
  compares the two).
"""
import importlib
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)        # `generated` is importable from the repository root

BACKENDS = ("generated", "materialised")


def _ssmax_init(train_length, num_heads):
    """SSMax's s = 1 / log(training length): the logits keep their scale at that length."""
    return {"ssmax": 1.0 / math.log(train_length)}


# The variants of the study. module: the generated module; init: its parameters' start
# (a function of the training length and the head count); frozen: parameters kept fixed;
# rope: rotary embedding of q and k before the attention call; forget_gate: the Forgetting
# Transformer's gates, a projection of x per head whose log-sigmoid cumulative sums are the
# positions (docs/positions.md).
VARIANTS = {
    "nope": dict(label="NoPE", module="uniform"),
    "rope": dict(label="RoPE", module="uniform", rope=True),
    "alibi": dict(label="ALiBi (fixed slopes)", module="laplace", frozen=("b",)),
    "ggd_nope": dict(label="GGD, NoPE-like start", module="bam",
                     init=lambda n, h: {"ta": 0.0, "tb": 0.0}),
    "ggd_alibi": dict(label="GGD, ALiBi-like start", module="bam"),
    "bam_ssmax": dict(label="BAM-SSMax", module="bam_ssmax", init=_ssmax_init),
    "fox": dict(label="Forgetting Transformer", module="forget_gate", forget_gate=True),
}


def load_module(name):
    """The generated module `generated.<name>`."""
    return importlib.import_module(f"generated.{name}")


# ----------------------------------------------------------------------------------------
# The priors written out by hand for the materialised baseline (d = i - j, causal).
# ----------------------------------------------------------------------------------------
def _bias_laplace(p, d):
    return -d.abs() / p["b"][:, None, None]


def _bias_bam(p, d):
    shift = 2 * torch.sinh(p["tm"])[:, None, None]
    return -torch.exp(p["ta"])[:, None, None] * (
        (d + shift).abs() + 1e-5) ** p["tb"][:, None, None]


MATERIALISED_BIAS = {"uniform": None, "laplace": _bias_laplace, "bam": _bias_bam,
                     "bam_ssmax": _bias_bam}


def forget_gate_positions(gates, cu_seqlens=None):
    """FoX's positions: the cumulative sums of the log forget gates, [B, H, N] from the gate
    logits [B, H, N]; c_i - c_j = sum of log f_t for t in (j, i]. With cu_seqlens (packed
    documents, B = 1) each document's sums start at its own first token."""
    c = F.logsigmoid(gates).cumsum(-1)
    if cu_seqlens is None:
        return c
    cu = cu_seqlens.to(device=c.device, dtype=torch.int64)
    before = F.pad(c, (1, 0))[..., cu[:-1]]                       # the sum before each document
    return c - torch.repeat_interleave(before, cu[1:] - cu[:-1], dim=-1)


def materialised_attention(module_name, params, q, k, v, positions=None):
    """Causal attention with the prior as a materialised [H, N, N] bias (autograd through it).
    For bam_ssmax the logit (s + bias) * ssmax * log(n_i) is made by scaling q and the bias
    row by row, n_i = i + 1 visible keys. positions (forget_gate): [B, H, N], the bias
    c_i - c_j per batch row, [B, H, N, N]."""
    n = q.shape[2]
    pos = torch.arange(n, device=q.device, dtype=torch.float32)
    d = pos[:, None] - pos[None, :]
    causal = torch.zeros(n, n, device=q.device).masked_fill(d < 0, -math.inf)
    if positions is not None:   # FoX: the prior's d is c_i - c_j
        bias = positions[..., :, None] - positions[..., None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(bias + causal).to(q.dtype))
    bias_fn = MATERIALISED_BIAS[module_name]
    bias = torch.zeros(1, n, n, device=q.device) if bias_fn is None else bias_fn(params, d)
    if module_name == "bam_ssmax":
        row_scale = params["ssmax"][:, None, None] * torch.log(pos + 1)[None, :, None]  # [H, N, 1]
        q = q * row_scale
        bias = bias * row_scale
    bias = bias + causal      # the mask last, so that no -inf meets a zero scale
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None].to(q.dtype))


def document_positions(cu_seqlens, device=None):
    """The position of every token of a packed sequence within its own document [N] (int64):
    0 at each document's start, as the generated modules count positions with cu_seqlens."""
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    return torch.arange(int(cu[-1]), device=device) - torch.repeat_interleave(cu[:-1], lengths)


def rotary(x, base=10000.0, positions=None, offset=0):
    """Rotary position embedding (rotate-half form) of x [B, H, N, D]; positions [N] (default
    offset, offset + 1, ...: a KV cache appends rows at offset > 0), e.g. document_positions()
    of a packed sequence."""
    n, dim = x.shape[2], x.shape[3]
    if positions is None:
        positions = torch.arange(offset, offset + n, device=x.device)
    inv_freq = base ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = positions.to(x.device, torch.float32)[:, None] * inv_freq[None]
    cos = torch.cat([angles.cos()] * 2, -1).to(x.dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(x.dtype)
    x1, x2 = x[..., :dim // 2], x[..., dim // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    """Multi-head causal self-attention with a variant's prior."""

    def __init__(self, variant, d_model, n_heads, train_length):
        super().__init__()
        spec = VARIANTS[variant]
        self.n_heads, self.rope, self.backend = n_heads, spec.get("rope", False), "generated"
        self.module_name = spec["module"]
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        mod = load_module(self.module_name)
        init = spec.get("init", lambda n, h: {})(train_length, n_heads)
        self.prior = getattr(mod, mod.PRIOR["class_name"])(num_heads=n_heads, init=init)
        for name in spec.get("frozen", ()):
            getattr(self.prior, "raw_" + name).requires_grad_(False)
        # FoX: one forget gate per head and token, from x (its bias starts the gates open)
        self.fgate = None
        if spec.get("forget_gate"):
            self.fgate = nn.Linear(d_model, n_heads)
            nn.init.constant_(self.fgate.bias, 3.0)

    def forward(self, x, cu_seqlens=None):
        """x [B, N, C]; with cu_seqlens, x is one packed row (B = 1) of documents that attend
        only within themselves, each with positions from 0 (RoPE's included)."""
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.n_heads, c // self.n_heads).permute(2, 0, 3, 1, 4)
        if cu_seqlens is not None and self.backend != "generated":
            raise ValueError("packed documents (cu_seqlens) need backend='generated': the "
                             "materialised-bias baseline builds one [H, N, N] bias per row and "
                             "does not take packing")
        if self.rope:
            positions = None if cu_seqlens is None else document_positions(cu_seqlens, x.device)
            q, k = rotary(q, positions=positions), rotary(k, positions=positions)
        gates = None
        if self.fgate is not None:   # [B, H, N], restarting in every packed document
            gates = forget_gate_positions(self.fgate(x).transpose(1, 2), cu_seqlens)
        if self.backend == "generated" and gates is not None:
            y = self.prior(q, k, v, causal=True, pos_q=gates, pos_k=gates, cu_seqlens_q=cu_seqlens,
                           cu_seqlens_k=cu_seqlens)
        elif self.backend == "generated":
            y = self.prior(q, k, v, causal=True, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens)
        else:
            y = materialised_attention(self.module_name, self.prior.prior_params(), q, k, v,
                                       gates)
        return self.out(y.transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, variant, d_model, n_heads, train_length):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = Attention(variant, d_model, n_heads, train_length)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x, cu_seqlens=None):
        x = x + self.attn(self.ln1(x), cu_seqlens)
        return x + self.mlp(self.ln2(x))


class TinyDecoder(nn.Module):
    """Token embedding (no absolute positions: the prior or RoPE is the only position signal),
    a few blocks, a final norm and an untied output layer."""

    def __init__(self, variant, vocab_size, train_length, d_model=64, n_layers=2, n_heads=4):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(Block(variant, d_model, n_heads, train_length)
                                    for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def set_backend(self, backend):
        """Run attention through the generated module or the materialised-bias baseline."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        for block in self.blocks:
            block.attn.backend = backend

    def forward(self, seq, positions=None, cu_seqlens=None):
        """Logits [B, N, V]; with positions (a 1-D index), only at those positions. With
        cu_seqlens (int32 [docs + 1], cumulative document lengths), seq [1, N] is packed
        documents, each seen as if alone (docs/masks.md)."""
        x = self.embed(seq)
        for block in self.blocks:
            x = block(x, cu_seqlens)
        if positions is not None:
            x = x[:, positions]
        return self.head(self.ln(x))

    def prior_params(self):
        """{layer: {param: [value per head]}} of the learned (and frozen) prior parameters."""
        return {layer: {name: [round(float(v), 6) for v in value.detach().reshape(-1)]
                        for name, value in block.attn.prior.prior_params().items()}
                for layer, block in enumerate(self.blocks)}
