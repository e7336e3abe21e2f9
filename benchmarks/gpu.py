"""GPU benchmark of the generated Triton kernels against their peers: TFLOP/s and time ratios,
forward and backward, causal, N from 1k to 64k; and a decode step against a KV cache.

    python benchmarks/gpu.py                                  # N = 1k..64k, D = 64 128, H=16, bf16
    python benchmarks/gpu.py --n 4096 16384 --head-dim 128    # a subset
    python benchmarks/gpu.py --peers sdpa flex-ggd bamgen-ggd --repeats 20 --json gpu.json
    python benchmarks/gpu.py --quick                          # CI: Triton interpreter, tiny sizes
    python benchmarks/gpu.py --n 4096 --markdown gpu.md       # also the report as markdown

Peers, all in one process on the same q, k, v, run alternately (one repeat of every peer, then
the next round) and reported as medians, like benchmarks/cpu.py:

* ``sdpa``            torch SDPA, causal, no bias (flash or cuDNN, whichever torch picks): the
                      floor, attention with no positional term at all.
* ``fa2-alibi``       flash_attn.flash_attn_func(causal=True, alibi_slopes=1/b), the hand-written
                      kernel for the Laplace prior (ALiBi); run only where ``import flash_attn``
                      works, on its native [B, N, H, D] layout.
* ``flex-<prior>``    torch.compile(flex_attention) with the prior as a score_mod and a causal
                      block mask; its parameters are captured tensors that require grad, so the
                      backward computes their gradients as bamgen's does. The GGD score_mod adds
                      BAM's epsilon (|d - mu| + 1e-5), or the beta gradient is NaN at d = mu.
* ``bamgen-<prior>``  the generated modules, backend="triton": generated/generalized_gaussian.py
                      (ggd: learnable alpha, beta, mu), generated/laplace.py (ALiBi, learnable b),
                      generated/uniform.py (NoPE, no parameters). ``bamgen-<prior>-torch`` is the
                      same module on backend="torch" (default in --quick only).
* ``bamgen-<prior>-inline``, ``bamgen-<prior>-table``  the prior built with that lowering
                      strategy (bamgen.load(..., strategy=)): one kernel variant against another
                      in the same run, where the model cannot decide (docs/performance.md);
                      their outputs are held to the shipped build's.
* ``bamgen-<prior>@<pins>``  a pinned kernel variant of ``bamgen-<prior>`` (Triton backend; a
                      decode peer too, --decode-peers bamgen-ggd@gather=coalesced):
                      pins, comma-separated, are ``<kernel>=<BLOCK_M>x<BLOCK_N>x<warps>x<stages>``
                      (kernel: fwd, bwd_dkdv, bwd_dq, decode) and ``gather=async|coalesced|direct``
                      (how the forward and decode kernels read a table prior's entries:
                      tiles.fwd_table_gather and FWD_TABLE_GATHER), ``dq_split=on|off`` and
                      ``dkdv_split=on|off`` (whether the dQ or dK/dV kernel splits off its
                      steady run: tiles.DQ_STEADY_AT, DKDV_STEADY_AT), ``kv=pointers|tma``
                      (how the forward reads K and V: tiles.FWD_TMA_AT, launch.kv_tma),
                      ``table=device|host`` (where a table prior's distance table is built) and
                      ``dq_group=<count>`` (the learnable scalars a dQ launch sums:
                      tiles.GRAD_GROUPS), e.g.
                      ``bamgen-ggd@fwd=128x64x8x3`` or ``bamgen-ggd@gather=direct``; the calls
                      run inside ``bamgen.runtime.triton.launch.pinned``, the output is held to
                      ``bamgen-<prior>``'s, and the JSON keeps the pins (``variants``) for
                      benchmarks/model_check.py. A pinned tile is not checked for spills. A
                      pinned peer's backward runs on the calling thread (Peer.backward_of): to
                      time backward tiles, pin the base too (bamgen-ggd@bwd_dq=64x32x4x2
                      against bamgen-ggd@bwd_dq=64x16x4x2).
* ``flex-rpe``, ``bamgen-rpe``, ``bamgen-rpe-inline``  GGD over randomized integer positions
                      (sorted random integers from [0, 4N), Ruoss et al.), passed as pos_q = pos_k:
                      the shipped build reads its distance table at them (docs/positions.md,
                      "Integer positions"), the inline build computes the prior per score, flex
                      reads the positions in its score_mod.

Ratios are of times, bamgen over the peer with the same prior (flex-<prior>; fa2-alibi for
Laplace) and over sdpa: below 1 bamgen is faster. bamgen-uniform / sdpa is the cost of the
generated kernel itself; bamgen-ggd / bamgen-uniform that of the prior.

How it is timed. ``fwd`` is one forward under torch.no_grad() (inference). ``bwd`` is the
backward alone: a forward with grad runs untimed, then ``out.backward(dout)`` is timed, as
FlashAttention's benchmark_backward does; the gradients of the prior's parameters are included.
On a GPU every sample is one call between two CUDA events, after a 256 MiB write that flushes the
L2 cache (as triton.testing.do_bench does), so a call's Python launch overhead counts, as it does
for a user. FLOPs follow FlashAttention's benchmark: causal forward 4*B*H*N^2*D / 2, backward
2.5 times that; the prior's own arithmetic is not counted. Sizes follow it too: B*N = 16k tokens
(B = 16384 // N, at least 1), H = 16. Warm-up calls come first; their time (``first s``:
compiles, Triton JIT) is reported apart. torch.compile's caches are reset for every (N, D).
A peer that cannot run (no GPU, no flash_attn, a compile error, out of memory) is listed with
the reason under the tables instead of stopping the run. The last timed call of every peer is
kept, and each bamgen module's output is compared with the peers that compute its function
("Agreement", relative to the largest |value|; bf16 on a GPU, so about 1e-2 is expected there).

Decode steps (after the training sizes; ``--decode-n``, ``--decode-batch``, ``--kv-heads``):
one new query row per head against N cached keys, GQA, no gradient, timed as ``fwd`` above.
Peers: ``sdpa`` (no bias), ``flex-ggd`` (the query at position N - 1), ``bamgen-<prior>`` (the
split-KV decode kernels), ``bamgen-ggd-forward`` (the same call through the forward kernel, as
a step ran before the decode kernels) and, in --quick, ``bamgen-ggd-torch`` (backend "torch":
on the CPU tensors of --quick, the CPU decode step; on CUDA tensors, the torch path on the GPU). Their rows are marked "(decode)"; GB/s counts K and V read once.

--quick is the CI smoke run: no GPU, TRITON_INTERPRET=1 set before Triton is imported, B=1, H=2,
N = 32 48, D=16, fp32 on the CPU. The bamgen kernels run in the Triton interpreter and on the
torch backend, SDPA on the CPU, FlexAttention eagerly and forward only (it has no CPU backward).
It also checks, and exits 1 if not: that the interpreted kernels' output and gradients (q, k, v
and every parameter) match the torch backend's, and that flex-<prior> and sdpa compute the same
function as the bamgen module they are compared with. Its timings are not GPU figures.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "--quick" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton

import argparse
import contextlib
import importlib
import importlib.util
import io
import json
import math
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PRIORS = {"ggd": "generalized_gaussian", "laplace": "laplace", "uniform": "uniform"}
# run when named (--peers): BAM-SSMax, and the field's priors of docs/priors.md against flex with
# the same score_mod; fox is forget_gate over per-head positions c (pos_q = pos_k = c); rpe is
# GGD over randomized integer positions (Ruoss et al.: sorted random integers from [0, 4N)),
# which the shipped build reads from its distance table and bamgen-rpe-inline computes per score
MORE_PRIORS = {"ssmax": "bam_ssmax", "t5": "t5", "fire": "fire", "fox": "forget_gate",
               "rpe": "generalized_gaussian"}
ALL_PRIORS = {**PRIORS, **MORE_PRIORS}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GPU_NS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
GPU_DECODE_NS = [4096, 32768]       # cache lengths of the decode steps
GPU_DECODE_BATCHES = [1, 64]        # one sequence (latency), a serving batch (bandwidth)
# decode: 80 cached keys are three splits of the decode kernel under the interpreter
QUICK = dict(n=[32, 48], head_dim=[16], heads=2, tokens=1, dtype="fp32", decode_n=[80],
             decode_batch=[2])
QUICK_TOL = 1e-4  # relative to the largest magnitude of the reference tensor
SMOKE_HEADER = "interpreter smoke run: timings are not GPU figures"


# --------------------------------------------------------------------------------------------
# the problem and its peers


@dataclass
class Config:
    n: int
    batch: int
    heads: int
    dim: int
    dtype: torch.dtype
    device: str

    def fwd_flops(self) -> float:
        return 4 * self.batch * self.heads * self.n ** 2 * self.dim / 2

    def bwd_flops(self) -> float:
        return 2.5 * self.fwd_flops()


@dataclass
class Peer:
    """One way of computing attention: ``fn(*inputs)``. Gradients flow to ``inputs`` and to
    ``captured`` (tensors the function closes over, such as flex's score_mod parameters)."""
    name: str
    fn: Callable[..., torch.Tensor]
    inputs: list
    dout: torch.Tensor
    captured: list = field(default_factory=list)
    backward: bool = True
    bnhd: bool = False  # output in [B, N, H, D] (flash_attn's layout)
    fallback: Callable[[], "Peer"] | None = None  # a cheaper variant if this one fails
    last: list = field(default_factory=list)  # see keep()
    base: str | None = None          # a pinned variant's base peer (bamgen-<prior>@<pins>)
    variant: "Variant | None" = None  # ... and its pins
    configs: Callable[[], dict] | None = None   # after a run: the configs its autotuners kept

    def __post_init__(self):
        self.frozen = [t.detach() for t in self.inputs]  # same storage, no autograd

    def pins(self) -> contextlib.AbstractContextManager:
        """The block a call runs in: a variant's pins, else nothing."""
        return contextlib.nullcontext() if self.variant is None else self.variant.context()

    def call(self) -> torch.Tensor:
        """One call recording autograd."""
        with self.pins():
            return self.fn(*self.inputs)

    def infer(self) -> torch.Tensor:
        """One inference call: no grad mode and inputs that do not require grad (a module may
        save more for the backward when they do)."""
        with torch.no_grad(), self.pins():
            return self.fn(*self.frozen)

    def backward_of(self, out: torch.Tensor) -> None:
        """The backward of a call's output. A pinned variant's backward kernels are launched
        here, outside the call, so its pins hold here too, and on the calling thread: autograd
        runs a CUDA backward on a device thread of its own, which the pins' ContextVar does not
        reach (set_multithreading_enabled(False) keeps it on this one)."""
        if self.variant is None:
            out.backward(self.dout)
            return
        with self.pins(), torch.autograd.set_multithreading_enabled(False):
            out.backward(self.dout)

    def leaves(self) -> list:
        return self.inputs + self.captured

    def zero_grad(self) -> None:
        for t in self.leaves():
            t.grad = None

    def keep(self, out: torch.Tensor, grads: bool) -> None:
        """Hold the last call's output, in [B, H, N, D], and gradients for ``agreement``."""
        out = out.detach().transpose(1, 2) if self.bnhd else out.detach()
        self.last = [out] + ([t.grad for t in self.leaves()] if grads else [])


class Unavailable(Exception):
    """A peer that cannot run here; the message says why."""


STRATEGIES = ("inline", "table")


def load_module(prior: str, strategy: str | None = None):
    """The shipped build of ``prior``, or its build with another lowering strategy."""
    if strategy is None:
        return importlib.import_module(f"generated.{ALL_PRIORS[prior]}")
    import bamgen
    return bamgen.load(ALL_PRIORS[prior], strategy=strategy)


def make_inputs(cfg: Config):
    g = torch.Generator().manual_seed(0)
    shape = (cfg.batch, cfg.heads, cfg.n, cfg.dim)
    q, k, v, dout = (torch.randn(shape, generator=g).to(cfg.device, cfg.dtype) for _ in range(4))
    return [t.requires_grad_() for t in (q, k, v)], dout


def learnable_params(prior: str, cfg: Config) -> dict:
    torch.manual_seed(0)  # the vector parameters' random inits (t5, fire)
    return {name: t.to(cfg.device).requires_grad_()
            for name, t in load_module(prior).default_params(cfg.heads).items()}


def fox_positions(cfg: Config) -> torch.Tensor:
    """FoX's positions: per head, the cumulative sum of log forget gates, [B, H, N] float32, a
    leaf that requires grad (the gates' gradients are what a FoX layer trains). Gate logits
    around 3 keep the gates near 1, as FoX initialises them."""
    g = torch.Generator().manual_seed(1)
    logits = 3.0 + torch.randn(cfg.batch, cfg.heads, cfg.n, generator=g)
    c = F.logsigmoid(logits).cumsum(-1)
    return c.to(cfg.device).requires_grad_()


def rpe_positions(cfg: Config) -> torch.Tensor:
    """Randomized positions (Ruoss et al. 2023): per sequence, N sorted distinct integers drawn
    from [0, 4N), [B, N] int64 (integers take no gradient)."""
    g = torch.Generator().manual_seed(2)
    rows = [torch.sort(torch.randperm(4 * cfg.n, generator=g)[:cfg.n]).values
            for _ in range(cfg.batch)]
    return torch.stack(rows).to(cfg.device)


def sdpa_peer(cfg, qkv, dout) -> Peer:
    return Peer("sdpa", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                list(qkv), dout)


def fa2_peer(cfg, qkv, dout) -> Peer:
    if cfg.device != "cuda":
        raise Unavailable("no GPU")
    if cfg.dtype == torch.float32:
        raise Unavailable("flash_attn has no fp32 kernel")
    try:
        from flash_attn import flash_attn_func
    except Exception as err:  # ImportError, or a build that does not match this torch
        raise Unavailable(f"flash_attn not importable ({type(err).__name__}: {err})") from None
    bnhd = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in qkv]
    slopes = (1.0 / load_module("laplace").default_params(cfg.heads)["b"]).to(cfg.device)
    return Peer("fa2-alibi", lambda q, k, v: flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes),
                bnhd, dout.transpose(1, 2).contiguous(), bnhd=True)


def score_mod(prior: str, params: dict):
    """The prior as a FlexAttention score_mod (score is already scaled q.k)."""
    if prior == "uniform":
        return None
    if prior == "laplace":
        b = params["b"]
        return lambda score, bi, h, qi, kj: score - torch.abs((qi - kj).to(torch.float32)) / b[h]
    if prior in ("ggd", "rpe"):
        alpha, beta, mu = params["alpha"], params["beta"], params["mu"]
        pos = params.get("pos")   # rpe: the tokens' integer positions, [B, N]

        def ggd(score, bi, h, qi, kj):
            if pos is None:
                d = (qi - kj).to(torch.float32)
            else:
                d = (pos[bi, qi] - pos[bi, kj]).to(torch.float32)
            return score - torch.pow((torch.abs(d - mu[h]) + 1e-5) / alpha[h], beta[h])
        return ggd
    return FIELD_SCORE_MODS[prior](params)


def _t5_score_mod(params):
    """priors/t5.yaml: w[h, bucket(max(i - j, 0))], 16 exact buckets then 16 logarithmic ones up
    to 128 (HF's T5Attention._relative_position_bucket, causal)."""
    w = params["w"]

    def t5(score, bi, h, qi, kj):
        r = torch.clamp(qi - kj, min=0)
        far = 16 + torch.floor(torch.log(r.to(torch.float32) / 16) * (16 / math.log(8)))
        bucket = torch.where(r < 16, r, torch.clamp(far, max=31).to(r.dtype))
        return score + w[h, bucket]
    return t5


def _fire_score_mod(params):
    """priors/fire.yaml: an MLP of x = log(c|d| + 1) / log(c max(i, L) + 1), summed over its
    32 hidden units term by term (a score_mod sees one score at a time)."""
    c, L, w1, b1, w2, b2 = (params[k] for k in ("c", "L", "w1", "b1", "w2", "b2"))

    def fire(score, bi, h, qi, kj):
        d = (qi - kj).to(torch.float32)
        i = qi.to(torch.float32)
        x = torch.log(c[h] * torch.abs(d) + 1) / torch.log(c[h] * torch.maximum(i, L[h]) + 1)
        bias = b2[h]
        for m in range(w1.shape[0]):
            bias = bias + w2[h, m] * torch.relu(w1[m] * x + b1[m])
        return score + bias
    return fire


def _fox_score_mod(params):
    """priors/forget_gate.yaml over positions: c_i - c_j, c captured per (batch, head, token).
    flex refuses two reads of one tensor that requires grad, so the keys read a second leaf
    with the same values (c's gradient is the sum of the two)."""
    cq, ck = params["c"], params["c_keys"]
    return lambda score, bi, h, qi, kj: score + cq[bi, h, qi] - ck[bi, h, kj]


FIELD_SCORE_MODS = {"t5": _t5_score_mod, "fire": _fire_score_mod, "fox": _fox_score_mod}


def flex_peer(prior: str, cfg, qkv, dout, learnable: bool = True) -> Peer:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    params = learnable_params(prior, cfg)
    if prior == "fox":
        params["c"] = fox_positions(cfg)
        params["c_keys"] = params["c"].detach().clone().requires_grad_()
    if prior == "rpe":
        params["pos"] = rpe_positions(cfg)
    if prior == "ssmax":
        raise Unavailable("no flex score_mod written for BAM-SSMax (its scale reads n)")
    if not learnable:
        params = {k: t.detach() for k, t in params.items()}
    mod = score_mod(prior, params)
    on_gpu = cfg.device == "cuda"
    # built once per size, untimed; eagerly it holds an [N, N] bool for a moment (4 GiB at 64k)
    mask = create_block_mask(lambda b, h, qi, kj: kj <= qi, None, None, cfg.n, cfg.n,
                             device=cfg.device)
    # on the CPU: eagerly (no compile), forward only
    attend = torch.compile(flex_attention, dynamic=False) if on_gpu else flex_attention
    fallback = None
    if on_gpu and learnable and params:
        fallback = lambda: flex_peer(prior, cfg, qkv, dout, learnable=False)
    return Peer(f"flex-{prior}", lambda q, k, v: attend(q, k, v, score_mod=mod, block_mask=mask),
                list(qkv), dout, captured=[t for t in params.values() if t.requires_grad],
                backward=on_gpu, fallback=fallback)


def bamgen_peer(prior: str, backend: str, cfg, qkv, dout, strategy: str | None = None) -> Peer:
    try:
        module = load_module(prior, strategy)
    except ValueError as err:   # a strategy the prior cannot take (a SpecError saying why)
        raise Unavailable(f"strategy {strategy}: {str(err).splitlines()[0]}") from None
    params = learnable_params(prior, cfg)
    if prior == "fox":   # the positions are the last input: gradients flow to them
        params["c"] = fox_positions(cfg)
    names = list(params)
    rpe = rpe_positions(cfg) if prior == "rpe" else None

    def fn(q, k, v, *values):
        kwargs = dict(zip(names, values))
        if prior == "fox":
            c = kwargs.pop("c")
            kwargs.update(pos_q=c, pos_k=c)
        if rpe is not None:
            kwargs.update(pos_q=rpe, pos_k=rpe)
        return module.attention(q, k, v, **kwargs, causal=True, backend=backend)
    name = f"bamgen-{prior}" + ("-torch" if backend == "torch" else "") + (f"-{strategy}" if strategy else "")
    return Peer(name, fn, list(qkv) + list(params.values()), dout)


@dataclass(frozen=True)
class Variant:
    """The pins of a ``bamgen-<prior>@<pins>`` peer: tile configs per kernel, the forward's
    table gather, whether the dQ and dK/dV kernels split off their steady runs and how the
    forward reads K and V, where the distance table is built and how many learnable scalars a
    dQ launch sums (None: the default)."""
    tiles: tuple[tuple[str, tuple[int, int, int, int]], ...] = ()
    gather: str | None = None
    dq_split: bool | None = None
    dkdv_split: bool | None = None
    kv: str | None = None
    table: str | None = None
    dq_group: int | None = None

    @classmethod
    def parse(cls, text: str) -> "Variant":
        """``fwd=128x64x8x3,gather=direct,dq_split=off,dkdv_split=on,kv=pointers,table=host,
        dq_group=6`` (ValueError saying what is wrong)."""
        from bamgen.runtime.triton.launch import KV_READS, TABLE_BUILDS
        from bamgen.runtime.triton.tiles import INTERPRET_TILES, TABLE_GATHERS
        tiles, gather, splits, kv, table, dq_group = {}, None, {}, None, None, None
        for pin in text.split(","):
            key, _, value = pin.partition("=")
            if (key in tiles or key in splits or (key == "gather" and gather is not None)
                    or (key == "kv" and kv is not None) or (key == "table" and table is not None)
                    or (key == "dq_group" and dq_group is not None)):
                raise ValueError(f"pin {key!r} given twice: give each kernel's tile, the gather, "
                                 f"each split, kv, table and dq_group once")
            if key == "gather" and value in TABLE_GATHERS:
                gather = value
            elif key == "kv" and value in KV_READS:
                kv = value
            elif key == "table" and value in TABLE_BUILDS:
                table = value
            elif key == "dq_group" and value.isdigit() and int(value) > 0:
                dq_group = int(value)
            elif key in ("dq_split", "dkdv_split") and value in ("on", "off"):
                splits[key] = value == "on"
            elif key in INTERPRET_TILES and len(value.split("x")) == 4 and all(
                    x.isdigit() and int(x) > 0 for x in value.split("x")):
                tiles[key] = tuple(int(x) for x in value.split("x"))
            else:
                raise ValueError(
                    f"pin {pin!r}: write <kernel>=<BLOCK_M>x<BLOCK_N>x<warps>x<stages> with kernel "
                    f"one of {', '.join(INTERPRET_TILES)}, gather= one of {', '.join(TABLE_GATHERS)}, "
                    f"or dq_split=on|off, dkdv_split=on|off, kv={'|'.join(KV_READS)}, "
                    f"table={'|'.join(TABLE_BUILDS)}, dq_group=<learnable scalars a dQ launch>")
        return cls(tuple(sorted(tiles.items())), gather, splits.get("dq_split"),
                   splits.get("dkdv_split"), kv, table, dq_group)

    def context(self):
        from bamgen.runtime.triton.launch import pinned
        return pinned(dict(self.tiles), self.gather, self.dq_split, self.dkdv_split, self.kv,
                      self.table, self.dq_group)

    def as_json(self) -> dict:
        return {"tiles": {k: list(v) for k, v in self.tiles}, "gather": self.gather,
                "dq_split": self.dq_split, "dkdv_split": self.dkdv_split, "kv": self.kv,
                "table": self.table, "dq_group": self.dq_group}


def split_variant(name: str) -> tuple[str, Variant | None]:
    """(base peer name, its Variant or None) of a --peers name."""
    base, at, pins = name.partition("@")
    return base, (Variant.parse(pins) if at else None)


def checked_name(text: str, names: list[str], what: str, unpinned: tuple[str, ...]) -> str:
    """A --peers / --decode-peers name: one of ``names``, or a bamgen one's pinned variant
    (bamgen-<prior>@<pins>, not one ending in ``unpinned``); argparse's error says why not."""
    base, at, _ = text.partition("@")
    if base not in names:
        raise argparse.ArgumentTypeError(f"{base!r} is not a {what}; choose from: {' '.join(names)}")
    if at:
        if not base.startswith("bamgen-") or base.endswith(unpinned):
            raise argparse.ArgumentTypeError(
                f"{text!r}: only a bamgen {what} on the Triton kernels takes pins (bamgen-<prior>@...)")
        try:
            split_variant(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None
    return text


def peer_name(text: str) -> str:
    """--peers' type: one of all_peers(), or bamgen-<prior>@<pins> (Variant)."""
    return checked_name(text, all_peers(), "peer", ("-torch",))


def default_peers(quick: bool) -> list[str]:
    names = ["sdpa", "fa2-alibi"]
    for prior in PRIORS:
        names += [f"flex-{prior}", f"bamgen-{prior}"] + ([f"bamgen-{prior}-torch"] if quick else [])
    return names


def all_peers() -> list[str]:
    """Every peer --peers accepts: the defaults, the tutorial kernel, and MORE_PRIORS'."""
    names = default_peers(True) + ["tutorial"]
    for prior in MORE_PRIORS:
        names += [f"flex-{prior}", f"bamgen-{prior}", f"bamgen-{prior}-torch"]
    return names + [f"bamgen-{prior}-{strategy}" for prior in ALL_PRIORS for strategy in STRATEGIES]


def tutorial_peer(cfg, qkv, dout, path: str | None) -> Peer:
    """Triton's fused-attention tutorial (python/tutorials/06-fused-attention.py of the Triton in
    use), the in-Triton floor for NoPE (docs/performance.md). It is not shipped: --tutorial
    names a copy. It computes in fp16 only (it casts P to fp16), and N must be a multiple of 128."""
    if cfg.device != "cuda":
        raise Unavailable("no GPU")
    if not path:
        raise Unavailable("--tutorial PATH not given")
    if cfg.dtype != torch.float16:
        raise Unavailable("the tutorial kernel is fp16 only (--dtype fp16)")
    spec = importlib.util.spec_from_file_location("triton_tutorial_attention", path)
    tutorial = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tutorial)
    scale = cfg.dim ** -0.5
    return Peer("tutorial", lambda q, k, v: tutorial.attention(q, k, v, True, scale),
                list(qkv), dout, configs=lambda: autotuned_configs(tutorial))


def autotuned_configs(module) -> dict[str, str]:
    """{kernel: the config its autotuner kept} of a module's autotuned kernels, named as
    benchmarks/tutorial_model.py names them, so that its model's pick meets the GPU's."""
    from triton.runtime.autotuner import Autotuner
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    from autotune_names import config_name
    return {name: config_name(kernel.best_config) for name, kernel in vars(module).items()
            if isinstance(kernel, Autotuner) and getattr(kernel, "best_config", None) is not None}


def pinned_peer(name: str, make: Callable[[str], Peer]) -> Peer | None:
    """The peer of a pinned name (bamgen-<prior>@<pins>, which peer_name or decode_peer_name
    checked): its base peer, make(base), with the pins; None for a name without pins."""
    base, variant = split_variant(name)
    if variant is None:
        return None
    peer = make(base)
    peer.name, peer.base, peer.variant = name, base, variant
    return peer


def make_peer(name: str, cfg, qkv, dout, tutorial: str | None = None) -> Peer:
    pinned = pinned_peer(name, lambda base: make_peer(base, cfg, qkv, dout, tutorial))
    if pinned is not None:
        return pinned
    if name == "sdpa":
        return sdpa_peer(cfg, qkv, dout)
    if name == "fa2-alibi":
        return fa2_peer(cfg, qkv, dout)
    if name == "tutorial":
        return tutorial_peer(cfg, qkv, dout, tutorial)
    kind, prior, *variant = name.split("-")  # names from all_peers()
    if kind == "flex":
        return flex_peer(prior, cfg, qkv, dout)
    if variant and variant[0] in STRATEGIES:
        return bamgen_peer(prior, "triton", cfg, qkv, dout, strategy=variant[0])
    return bamgen_peer(prior, variant[0] if variant else "triton", cfg, qkv, dout)


# --------------------------------------------------------------------------------------------
# timing


class Timer:
    """Seconds of one call of ``fn``: CUDA events around it after an L2 flush on a GPU,
    perf_counter on the CPU. ``host_s``: the last call's host seconds, from its start to its
    return (on a GPU: the launches, queued behind the flush; a call that waits for the device
    waits here too), which tells a call's host cost from its kernels' (docs/performance.md,
    "Fifth GPU session": the call against its kernel)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.host_s = 0.0
        if self.cuda:
            self.flush = torch.empty(256 * 2 ** 20, dtype=torch.int8, device="cuda")

    def __call__(self, fn) -> tuple[float, object]:
        """(seconds, what fn returned)"""
        if not self.cuda:
            t0 = time.perf_counter()
            value = fn()
            self.host_s = time.perf_counter() - t0
            return self.host_s, value
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.flush.zero_()
        start.record()
        t0 = time.perf_counter()
        value = fn()
        self.host_s = time.perf_counter() - t0
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, value

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def time_forward(timer: Timer, peer: Peer) -> float:
    seconds, out = timer(peer.infer)
    peer.keep(out, grads=False)
    return seconds


def time_backward(timer: Timer, peer: Peer) -> float:
    peer.zero_grad()
    out = peer.call()  # untimed
    seconds, _ = timer(lambda: peer.backward_of(out))
    peer.keep(out, grads=True)
    return seconds


def warm_up(timer: Timer, peer: Peer, rounds: int) -> float:
    """Run the peer until compiled; returns the seconds the first round took."""
    first = None
    for _ in range(rounds):
        t0 = time.perf_counter()
        time_forward(timer, peer)
        if peer.backward:
            time_backward(timer, peer)
        timer.sync()
        first = time.perf_counter() - t0 if first is None else first
    return first


def _reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:160] if text else ''}"


def set_up(names, make, device, timer, rounds, unavailable) -> tuple[list[Peer], dict]:
    """Build (``make(name)``) and warm up every peer; a failing one goes to ``unavailable`` with
    its reason."""
    peers, first = [], {}
    for name in names:
        try:
            peer = make(name)
        except Unavailable as err:
            unavailable[name] = str(err)
            continue
        while peer is not None:
            try:
                first[name] = warm_up(timer, peer, rounds)
                peers.append(peer)
                break
            except Exception as err:  # compile failure, OOM, unsupported feature
                if device == "cuda":
                    torch.cuda.empty_cache()
                if peer.fallback is None:
                    unavailable[name] = _reason(err)
                else:
                    unavailable[name] = (f"with learnable parameters: {_reason(err)}; "
                                         "retried with fixed ones")
                peer = peer.fallback() if peer.fallback else None
    return peers, first


def measure(peers: list[Peer], timer: Timer, repeats: int, unavailable: dict,
            each_round=None) -> dict:
    """Median seconds per (peer name, 'fwd' | 'bwd'), the peers taking turns every round, and
    the median host seconds of those calls per (peer name, 'fwd_host' | 'bwd_host'). each_round:
    called after every round with (rounds done, the medians so far)."""
    samples: dict = {}
    live = list(peers)
    for done in range(1, repeats + 1):
        for peer in list(live):
            try:
                samples.setdefault((peer.name, "fwd"), []).append(time_forward(timer, peer))
                samples.setdefault((peer.name, "fwd_host"), []).append(timer.host_s)
                if peer.backward:
                    samples.setdefault((peer.name, "bwd"), []).append(time_backward(timer, peer))
                    samples.setdefault((peer.name, "bwd_host"), []).append(timer.host_s)
            except Exception as err:
                unavailable[peer.name] = _reason(err)
                live.remove(peer)
        if each_round is not None:
            each_round(done, _medians(samples, live))
    return _medians(samples, live)


def _medians(samples: dict, live: list[Peer]) -> dict:
    live_names = {p.name for p in live}
    return {key: statistics.median(ts) for key, ts in samples.items() if key[0] in live_names}


def progress_of(progress, result_of):
    """measure's each_round: hands progress the size's result from the rounds done so far,
    marked partial (no agreement, no kernels: those read the last round's outputs)."""
    if progress is None:
        return None
    return lambda done, times: progress({**result_of(times, final=False), "partial_rounds": done})


# --------------------------------------------------------------------------------------------
# agreement between peers that compute the same function


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


def agreement(peers: list[Peer]) -> dict:
    """Relative max error of each bamgen module against the peers computing its function:
    forward against flex-<prior>, fa2-alibi (Laplace) and sdpa (uniform); forward and every
    gradient of the Triton backend against the torch backend, where both ran, and of a pinned
    variant against its base peer. It reads what
    each peer's last timed call left (``Peer.keep``): no extra calls."""
    by_name = {p.name: p for p in peers}
    refs = {f"bamgen-{p}": [f"flex-{p}"] for p in ALL_PRIORS}
    refs["bamgen-laplace"].append("fa2-alibi")
    refs["bamgen-uniform"] += ["sdpa", "tutorial"]
    refs.update({f"bamgen-{p}-{s}": [f"bamgen-{p}"] for p in ALL_PRIORS for s in STRATEGIES})
    errors = {}
    for name in refs:
        if name not in by_name:
            continue
        got = by_name[name].last
        torch_backend = by_name.get(name + "-torch")
        if torch_backend and len(got) > 1:
            pairs = zip(got, torch_backend.last, strict=True)
            errors[f"{name} vs {name}-torch fwd+grads"] = max(_rel_err(a, b) for a, b in pairs)
        for ref in refs[name]:
            if ref in by_name:
                errors[f"{name} vs {ref} fwd"] = _rel_err(got[0], by_name[ref].last[0])
    for peer in peers:   # a pinned variant computes its base's function, gradients included
        base = by_name.get(peer.base) if peer.variant is not None else None
        if base is not None and base.last:
            what = "fwd+grads" if len(peer.last) > 1 and len(base.last) == len(peer.last) else "fwd"
            pairs = zip(peer.last, base.last) if what == "fwd+grads" else [(peer.last[0], base.last[0])]
            errors[f"{peer.name} vs {base.name} {what}"] = max(_rel_err(a, b) for a, b in pairs)
    for name in refs:   # a module run on the torch backend alone is held to flex too
        flex, torch_backend = by_name.get(refs[name][0]), by_name.get(name + "-torch")
        if name not in by_name and flex and torch_backend:
            errors[f"{name}-torch vs {flex.name} fwd"] = _rel_err(torch_backend.last[0], flex.last[0])
    return errors


# --------------------------------------------------------------------------------------------
# decode: one generation step (one new query row) against a KV cache, no gradient


@dataclass
class DecodeConfig:
    """B sequences, each one new query row per query head against n cached keys (GQA: heads
    query heads over kv_heads key/value heads), as a generation step runs it."""
    n: int
    batch: int
    heads: int
    kv_heads: int
    dim: int
    dtype: torch.dtype
    device: str

    def flops(self) -> float:
        return 4 * self.batch * self.heads * self.n * self.dim

    def cache_bytes(self) -> float:
        """K and V, read once: what bounds a step on a GPU."""
        return 2 * self.batch * self.kv_heads * self.n * self.dim * self.dtype.itemsize


def make_decode_inputs(cfg: DecodeConfig):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(cfg.batch, cfg.heads, 1, cfg.dim, generator=g)
    k, v = (torch.randn(cfg.batch, cfg.kv_heads, cfg.n, cfg.dim, generator=g) for _ in range(2))
    return [t.to(cfg.device, cfg.dtype) for t in (q, k, v)]


def decode_score_mod(prior: str, params: dict, q_offset: int):
    """score_mod for a step: the query's position is q_offset (the last of the sequence)."""
    mod = score_mod(prior, params)
    if mod is None:
        return None
    return lambda score, bi, h, qi, kj: mod(score, bi, h, qi + q_offset, kj)


def decode_peer(name: str, cfg: DecodeConfig, qkv) -> Peer:
    """The peers of a decode step: ``sdpa`` (no bias), ``flex-<prior>``, ``bamgen-<prior>``
    (the split-KV decode kernels on a GPU, the CPU decode step on backend "torch"), and
    ``bamgen-<prior>-forward``: the same call through the forward kernel (what a step ran
    before the decode kernel existed), by asking for a gradient it does not use."""
    q_offset = cfg.n - 1
    pinned = pinned_peer(name, lambda base: decode_peer(base, cfg, qkv))
    if pinned is not None:
        return pinned
    if name == "sdpa":
        return Peer(name, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                    list(qkv), None, backward=False)
    kind, prior, *variant = name.split("-")
    params = {n: t.detach() for n, t in learnable_params(prior, cfg).items()}
    if kind == "flex":
        from torch.nn.attention.flex_attention import flex_attention
        mod = decode_score_mod(prior, params, q_offset)
        attend = torch.compile(flex_attention, dynamic=False) if cfg.device == "cuda" else flex_attention
        return Peer(name, lambda q, k, v: attend(q, k, v, score_mod=mod, enable_gqa=True),
                    list(qkv), None, backward=False)
    module = load_module(prior)
    backend = "torch" if variant == ["torch"] else "triton"

    def step(q, k, v):
        return module.attention(q, k, v, **params, causal=True, q_offset=q_offset, backend=backend)

    def through_forward_kernel(q, k, v):
        with torch.enable_grad():   # a backward could follow: the forward kernel runs
            return step(q.detach().requires_grad_(), k, v).detach()
    return Peer(name, through_forward_kernel if variant == ["forward"] else step, list(qkv), None,
                backward=False)


def default_decode_peers(quick: bool) -> list[str]:
    return (["sdpa", "flex-ggd", "bamgen-ggd", "bamgen-ggd-forward", "bamgen-laplace",
             "bamgen-uniform"] + (["bamgen-ggd-torch"] if quick else []))


def decode_peer_name(text: str) -> str:
    """--decode-peers' type: one of default_decode_peers(True), or a bamgen one's pinned
    variant (bamgen-ggd@gather=coalesced: the decode kernel's table read, or its tile)."""
    return checked_name(text, default_decode_peers(True), "decode peer", ("-torch", "-forward"))


def decode_agreement(peers: list[Peer]) -> dict:
    """The decode peers that compute one function, compared on their last outputs (a pinned
    variant with its base peer)."""
    by_name = {p.name: p for p in peers}
    pairs = [("bamgen-ggd", "flex-ggd"), ("bamgen-uniform", "sdpa"),
             ("bamgen-ggd", "bamgen-ggd-forward"), ("bamgen-ggd", "bamgen-ggd-torch")]
    pairs += [(p.name, p.base) for p in peers if p.variant is not None]
    return {f"decode {a} vs {b}": _rel_err(by_name[a].last[0], by_name[b].last[0])
            for a, b in pairs if a in by_name and b in by_name}


def run_decode_config(cfg: DecodeConfig, names: list[str], args, progress=None) -> dict:
    """One decode size's result; progress (if given) takes it after every round, marked
    partial (progress_of)."""
    if cfg.device == "cuda":
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    qkv = make_decode_inputs(cfg)
    timer = Timer(cfg.device)
    unavailable: dict = {}
    peers, first = set_up(names, lambda name: decode_peer(name, cfg, qkv), cfg.device, timer,
                          args.warmup, unavailable)

    def result_of(times, final=True):
        return _decode_result(cfg, peers, first, times, dict(unavailable), args, final)
    return result_of(measure(peers, timer, args.repeats, unavailable,
                             progress_of(progress, result_of)))


def _decode_result(cfg, peers, first, times, unavailable, args, final) -> dict:
    result = {"mode": "decode", "N": cfg.n, "B": cfg.batch, "H": cfg.heads, "Hk": cfg.kv_heads,
              "D": cfg.dim, "peers": {}, "unavailable": unavailable,
              "agreement": decode_agreement(peers) if final else {}}
    if final and args.kernels and cfg.device == "cuda":   # a step's kernels beside the call's time
        result["kernels"] = {p.name: kernel_times(p) for p in peers}
    for peer in peers:
        fwd = times.get((peer.name, "fwd"))
        if fwd is not None:
            result["peers"][peer.name] = {
                "fwd_s": fwd, "bwd_s": None, "first_s": first[peer.name],
                "fwd_host_s": times.get((peer.name, "fwd_host")),
                "fwd_tflops": cfg.flops() / fwd / 1e12, "bwd_tflops": None,
                "gb_per_s": cfg.cache_bytes() / fwd / 1e9}
    return result


# --------------------------------------------------------------------------------------------
# one configuration, and the tables


def run_config(cfg: Config, names: list[str], args, progress=None) -> dict:
    """One size's result; progress (if given) takes it after every round, marked partial
    (progress_of): a run stopped at a time limit keeps the rounds it finished, and those of a
    size whose agreement and kernels it was still reading."""
    if cfg.device == "cuda":
        torch._dynamo.reset()  # drop the last size's compiled flex graphs
        torch.cuda.empty_cache()
    qkv, dout = make_inputs(cfg)
    timer = Timer(cfg.device)
    unavailable: dict = {}
    peers, first = set_up(names, lambda name: forward_only(make_peer(name, cfg, qkv, dout, args.tutorial),
                                                           args.forward_only
                                                           and name not in args.backward_peers),
                          cfg.device, timer, args.warmup, unavailable)

    def result_of(times, final=True):
        return _config_result(cfg, peers, first, times, dict(unavailable), args, final)
    return result_of(measure(peers, timer, args.repeats, unavailable,
                             progress_of(progress, result_of)))


def _config_result(cfg, peers, first, times, unavailable, args, final) -> dict:
    result = {"N": cfg.n, "B": cfg.batch, "H": cfg.heads, "D": cfg.dim, "peers": {},
              "unavailable": unavailable, "agreement": agreement(peers) if final else {}}
    variants = {p.name: p.variant.as_json() for p in peers if p.variant is not None}
    if variants:   # the pins, as fields for benchmarks/model_check.py
        result["variants"] = variants
    configs = {p.name: p.configs() for p in peers if p.configs is not None}
    if any(configs.values()):   # what the autotuners kept, for benchmarks/tutorial_model.py
        result["configs"] = {name: kept for name, kept in configs.items() if kept}
    if final and args.kernels and cfg.device == "cuda":   # every peer's: SDPA's and flex's too
        result["kernels"] = {p.name: kernel_times(p) for p in peers}
    for peer in peers:
        fwd, bwd = times.get((peer.name, "fwd")), times.get((peer.name, "bwd"))
        if fwd is None:
            continue
        result["peers"][peer.name] = {
            "fwd_s": fwd, "bwd_s": bwd, "first_s": first[peer.name],
            "fwd_host_s": times.get((peer.name, "fwd_host")),
            "bwd_host_s": times.get((peer.name, "bwd_host")),
            "fwd_tflops": cfg.fwd_flops() / fwd / 1e12,
            "bwd_tflops": None if bwd is None else cfg.bwd_flops() / bwd / 1e12}
    return result


def forward_only(peer: Peer, only: bool) -> Peer:
    """--forward-only: the peer's forward alone (no backward timed, profiled or compiled)."""
    if only:
        peer.backward = False
        if peer.fallback is not None:
            fallback = peer.fallback
            peer.fallback = lambda: forward_only(fallback(), True)
    return peer


def kernel_times(peer: Peer, rounds: int = 3) -> dict:
    """Device microseconds per kernel, from torch.profiler: of one inference forward
    ("fwd:<kernel>") and of one forward with grad and its backward ("bwd:<kernel>"), averaged
    over ``rounds`` calls. These are the per-kernel points the GPU cost model is fit to
    (docs/performance.md, "The GPU cost model"); a profiler failure is recorded, not raised."""
    from torch.profiler import ProfilerActivity, profile
    phases = {"fwd": peer.infer}
    if peer.backward:
        phases["bwd"] = lambda: peer.backward_of(peer.call())
    found = {}
    try:
        for phase, fn in phases.items():
            peer.zero_grad()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(rounds):
                    fn()
                torch.cuda.synchronize()
            for evt in prof.key_averages():
                us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
                if us:
                    found[f"{phase}:{evt.key}"] = {"us": us / rounds, "calls": evt.count / rounds}
    except Exception as err:   # an old torch, a profiler the machine refuses
        found["error"] = _reason(err)
    return found


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def _ms(seconds):
    return _f(None if seconds is None else seconds * 1e3, ".3f")


def _ratio(a, b):
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def print_results(results: list[dict], args, env: dict) -> None:
    print_header(args, env)
    training = [r for r in results if r.get("mode") != "decode"]
    print_times(training)
    print_ratios(training)
    print_decode([r for r in results if r.get("mode") == "decode"])
    print_notes(results)


def print_decode(results: list[dict]) -> None:
    """A decode step's time, the K/V cache it reads per second, and its ratios."""
    if not results:
        return
    print("\nDecode step: one new query row per head against N cached keys (GQA), no gradient; "
          "GB/s: K and V read per second; ratios of times (below 1: faster)\n")
    print("| N | B | Hq/Hk | D | peer | us | GB/s | / sdpa | / flex | / bamgen forward kernel |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        t = lambda peer: r["peers"].get(peer, {}).get("fwd_s")
        for name, p in r["peers"].items():
            prior = name.split("-")[1] if name.startswith(("bamgen-", "flex-")) else None
            flex = f"flex-{prior}" if name.startswith("bamgen-") else None
            forward = f"bamgen-{prior}-forward" if name == f"bamgen-{prior}" else None
            print(f"| {r['N']} | {r['B']} | {r['H']}/{r['Hk']} | {r['D']} | {name} | "
                  f"{_f(p['fwd_s'] * 1e6, '.1f')} | {_f(p['gb_per_s'], '.3g')} | "
                  f"{_ratio(p['fwd_s'], t('sdpa')) if name != 'sdpa' else '-'} | "
                  f"{_ratio(p['fwd_s'], t(flex)) if flex else '-'} | "
                  f"{_ratio(p['fwd_s'], t(forward)) if forward else '-'} |")


def print_header(args, env: dict) -> None:
    print()
    if args.quick:
        print(f"**{SMOKE_HEADER}** (Triton interpreter and torch on the CPU)\n")
    batch = "B=1" if args.quick else f"B*N = {args.tokens} tokens (B at least 1)"
    print(f"{env['device']}; torch {env['torch']}, triton {env['triton']}, flash_attn "
          f"{env['flash_attn']}. H={args.heads}, {batch}, {args.dtype}, causal; median of "
          f"{args.repeats} alternating repeats. fwd: one forward under no_grad; bwd: the backward "
          "alone, parameter gradients included. FLOPs: causal fwd 4*B*H*N^2*D/2, bwd 2.5x that. "
          "first s: the first (compiling) fwd + fwd/bwd."
          + (f" A one-element kernel's launch takes {env['launch_us']:.1f} us of host time."
             if env.get("launch_us") is not None else "") + "\n")


def print_times(results: list[dict]) -> None:
    print("| N | B | D | peer | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | first s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for name, p in r["peers"].items():
            print(f"| {r['N']} | {r['B']} | {r['D']} | {name} | {_ms(p['fwd_s'])} | "
                  f"{_f(p['fwd_tflops'], '.3g')} | {_ms(p['bwd_s'])} | "
                  f"{_f(p['bwd_tflops'], '.3g')} | {_f(p['first_s'], '.1f')} |")


def print_ratios(results: list[dict]) -> None:
    print("\nTime ratios, bamgen / peer (below 1: bamgen is faster); flex-<prior> and fa2-alibi "
          "(for laplace) compute the same function\n")
    print("| N | D | bamgen | fwd / sdpa | bwd / sdpa | fwd / flex | bwd / flex | fwd / fa2-alibi | "
          "bwd / fa2-alibi |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        t = lambda peer, kind: r["peers"].get(peer, {}).get(f"{kind}_s")
        for name, p in r["peers"].items():
            if not name.startswith("bamgen-"):
                continue
            prior = name.split("-")[1]
            refs = ("sdpa", f"flex-{prior}", "fa2-alibi" if prior == "laplace" else None)
            cells = [_ratio(p[f"{kind}_s"], t(ref, kind)) for ref in refs for kind in ("fwd", "bwd")]
            print(f"| {r['N']} | {r['D']} | {name} | " + " | ".join(cells) + " |")


SUMMARY_COLUMNS = ("D", "N", "B", "peer", "fwd ms", "bwd ms", "fwd TFLOP/s", "bwd TFLOP/s",
                   "fwd / sdpa", "bwd / sdpa", "fwd / flex", "bwd / flex", "fwd / fa2-alibi",
                   "bwd / fa2-alibi", "first s")


def summary_table(results: list[dict]) -> list[str]:
    """Times and ratios in one markdown table, one row per (D, N, peer): what --markdown
    writes. Ratios are the row's time over the peer's (sdpa; flex-<prior> with the row's prior;
    fa2-alibi for Laplace rows), "-" where that peer did not run or computes another function.
    Decode steps follow, their peers marked "(decode)": N is the cache's length, "fwd ms" the
    step, and the ratios are against the same peers' steps."""
    lines = ["| " + " | ".join(SUMMARY_COLUMNS) + " |", "|" + "---|" * len(SUMMARY_COLUMNS)]
    for r in sorted(results, key=lambda r: (r.get("mode") == "decode", r["D"], r["N"], r["B"])):
        t = lambda peer, kind: r["peers"].get(peer, {}).get(f"{kind}_s")
        label = " (decode)" if r.get("mode") == "decode" else ""
        for name, p in r["peers"].items():
            prior = name.split("-")[1] if name.startswith(("bamgen-", "flex-")) else None
            refs = ["sdpa",
                    f"flex-{prior}" if name.startswith("bamgen-") else None,
                    "fa2-alibi" if prior == "laplace" else None]
            cells = [_ratio(p[f"{kind}_s"], t(ref, kind)) if ref and ref != name else "-"
                     for ref in refs for kind in ("fwd", "bwd")]
            lines.append(f"| {r['D']} | {r['N']} | {r['B']} | {name}{label} | {_ms(p['fwd_s'])} | "
                         f"{_ms(p['bwd_s'])} | {_f(p['fwd_tflops'], '.3g')} | "
                         f"{_f(p['bwd_tflops'], '.3g')} | " + " | ".join(cells) +
                         f" | {_f(p['first_s'], '.1f')} |")
    return lines


def markdown_report(results: list[dict], args, env: dict) -> str:
    """The --markdown file: the set-up in one paragraph, the summary table, then what did not
    run and how the peers agreed, as lists."""
    with contextlib.redirect_stdout(io.StringIO()) as header:
        print_header(args, env)
    with contextlib.redirect_stdout(io.StringIO()) as notes:
        print_notes(results)
    command = "python benchmarks/gpu.py " + " ".join(args.argv)
    return (f"# benchmarks/gpu.py on {env['device']}\n\n`{command.strip()}`\n"
            + header.getvalue() + "\n".join(summary_table(results)) + "\n" + notes.getvalue())


def print_notes(results: list[dict]) -> None:
    notes = {}
    for r in results:
        for name, why in r["unavailable"].items():
            notes.setdefault((name, why), []).append(f"{r['N']}/{r['D']}")
    if notes:
        print("\nNot run or not complete (N/D):")
        for (name, why), where in notes.items():
            print(f"* {name}: {why} [{', '.join(where)}]")
    print("\nAgreement (max |difference| / max |reference|):")
    for r in results:
        if r["agreement"]:
            print(f"* N={r['N']} D={r['D']}: " + ", ".join(f"{k} {v:.1e}" for k, v in r["agreement"].items()))


def environment(device: str) -> dict:
    def version(name):
        try:
            return importlib.import_module(name).__version__
        except Exception:
            return "not installed"
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (no GPU)"
    env = {"device": name, "torch": torch.__version__, "triton": version("triton"),
           "flash_attn": version("flash_attn") if device == "cuda" else "not used"}
    if device == "cuda":   # the family a model compiles for (benchmarks/tutorial_model.py)
        env["capability"] = list(torch.cuda.get_device_capability())
    env["launch_us"] = launch_host_us(device)
    return env


def launch_host_us(device: str, launches: int = 200) -> float:
    """Host microseconds per launch of a one-element kernel (torch's add_), the median of five
    runs of ``launches`` launches queued without a wait: what a call pays per kernel before its
    kernels run, beside its kernels' own times (docs/performance.md, "Fifth GPU session": a
    forward call took 0.5-0.9 ms more than its kernel)."""
    x = torch.zeros(1, device=device)
    x.add_(1)
    runs = []
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(launches):
            x.add_(1)
        runs.append((time.perf_counter() - t0) / launches * 1e6)
    if device == "cuda":
        torch.cuda.synchronize()
    return statistics.median(runs)


def failed_checks(results: list[dict]) -> list[str]:
    return [f"N={r['N']} D={r['D']} {k}: {v:.2e} > {QUICK_TOL:.0e}"
            for r in results for k, v in r["agreement"].items() if not v <= QUICK_TOL]


# --------------------------------------------------------------------------------------------


def lift_recompile_limits() -> None:
    """flex_attention is compiled once per score_mod, grad mode, N and D: more than dynamo's
    default of 8 recompiles of one function (past which it would silently run eagerly)."""
    config = torch._dynamo.config
    for new, old, value in (("recompile_limit", "cache_size_limit", 64),
                            ("accumulated_recompile_limit", "accumulated_cache_size_limit", 4096)):
        setattr(config, new if hasattr(config, new) else old, value)


def quiet_expected_warnings() -> None:
    """The smoke run calls flex_attention eagerly on purpose, and the interpreter evaluates
    masked-out lanes too (log of 0 and the like)."""
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", help="sequence lengths (default 1024 .. 65536)")
    ap.add_argument("--head-dim", type=int, nargs="+", help="head dims (default 64 128)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16384, help="B = max(1, tokens // N)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--peers", nargs="+", type=peer_name, metavar="PEER",
                    help=f"subset of: {' '.join(all_peers())}, and pinned variants "
                         f"bamgen-<prior>@<pins> (default: {' '.join(default_peers(False))})")
    ap.add_argument("--kernels", action="store_true",
                    help="also record each peer's kernels' device times (SDPA's and flex's "
                         "too), from torch.profiler, in the JSON (the cost model's fit reads "
                         "bamgen's)")
    ap.add_argument("--tutorial", metavar="PATH",
                    help="a copy of Triton's python/tutorials/06-fused-attention.py, for the "
                         "'tutorial' peer (fp16)")
    ap.add_argument("--forward-only", action="store_true",
                    help="time (and with --kernels profile) the forwards alone: forward kernel "
                         "variants need no backward, and compile in a fraction of the time")
    ap.add_argument("--backward-peers", nargs="+", type=peer_name, default=[], metavar="PEER",
                    help="with --forward-only, peers (of --peers) whose backward is timed and "
                         "profiled too: backward kernel variants beside the shipped kernel")
    ap.add_argument("--repeats", type=int, help="alternating rounds; medians reported (default 10; "
                                                "--quick: 1)")
    ap.add_argument("--warmup", type=int, help="untimed rounds before (compiles; default 2; "
                                               "--quick: 1)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--markdown", metavar="PATH",
                    help="also write the set-up, one table of times and ratios, and the notes "
                         "as markdown (what make gpu-check keeps in docs/results/gpu/)")
    ap.add_argument("--decode-n", type=int, nargs="*",
                    help="cache lengths of the decode steps (default 4096 32768; none: no decode)")
    ap.add_argument("--decode-batch", type=int, nargs="+", help="sequences per decode step (default 1 64)")
    ap.add_argument("--kv-heads", type=int, default=None,
                    help="key/value heads of the decode steps (default heads / 4: GQA)")
    ap.add_argument("--decode-peers", nargs="+", type=decode_peer_name, metavar="PEER",
                    help=f"subset of: {' '.join(default_decode_peers(True))}, and pinned variants "
                         "of the bamgen ones (bamgen-ggd@gather=coalesced)")
    ap.add_argument("--quick", action="store_true",
                    help="CI smoke run on the CPU under the Triton interpreter, with checks "
                         "(fixes H=2, B=1, fp32; one repeat unless --repeats)")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.n = args.n or QUICK["n"]
        args.head_dim = args.head_dim or QUICK["head_dim"]
        args.heads, args.tokens, args.dtype = QUICK["heads"], QUICK["tokens"], QUICK["dtype"]
        args.repeats = 1 if args.repeats is None else args.repeats
        args.warmup = 1 if args.warmup is None else args.warmup
        args.decode_n = QUICK["decode_n"] if args.decode_n is None else args.decode_n
        args.decode_batch = args.decode_batch or QUICK["decode_batch"]
    args.n = args.n or GPU_NS
    args.repeats = 10 if args.repeats is None else args.repeats
    args.warmup = 2 if args.warmup is None else args.warmup
    args.decode_n = GPU_DECODE_NS if args.decode_n is None else args.decode_n
    args.decode_batch = args.decode_batch or GPU_DECODE_BATCHES
    args.kv_heads = args.kv_heads or max(1, args.heads // 4)
    if args.kv_heads < 1 or args.heads % args.kv_heads:
        ap.error(f"--kv-heads {args.kv_heads} must divide the query heads ({args.heads})")
    args.head_dim = args.head_dim or [64, 128]
    if args.backward_peers and not args.forward_only:
        ap.error("--backward-peers: without --forward-only every peer's backward is timed; "
                 "give --forward-only, or leave --backward-peers out")
    missing = [name for name in args.backward_peers if name not in (args.peers or ())]
    if missing:
        ap.error(f"--backward-peers {' '.join(missing)}: not among --peers; name each in --peers "
                 "too")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        os.environ["TRITON_INTERPRET"] = "1"  # read by the generated modules at each call
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        print("no GPU: nothing to measure (torch.cuda.is_available() is False); "
              "--quick runs the CPU smoke run under the Triton interpreter")
        return 1
    if device == "cuda":
        lift_recompile_limits()
    else:
        quiet_expected_warnings()
    names = args.peers or default_peers(args.quick)
    env = environment(device)
    print(f"{env['device']}, torch {env['torch']}; peers: {' '.join(names)}", flush=True)
    results = []

    def save(partial=None):
        """After every size, and within a size after every round (partial: its result so far),
        so that a run stopped at a time limit keeps what it measured."""
        if args.json:   # (written aside, then renamed: a kill mid-write leaves the last one)
            path = Path(args.json)
            aside = path.with_name(path.name + ".part")
            aside.write_text(json.dumps({"env": env, "args": vars(args),
                                         "results": results + [partial] * bool(partial)}, indent=1))
            os.replace(aside, path)
    for dim in args.head_dim:
        for n in args.n:
            cfg = Config(n, max(1, args.tokens // n), args.heads, dim, DTYPES[args.dtype], device)
            t0 = time.perf_counter()
            results.append(run_config(cfg, names, args, save))
            save()
            print(f"N={n} D={dim} done in {time.perf_counter() - t0:.0f} s", flush=True)
    decode_names = args.decode_peers or default_decode_peers(args.quick)
    for dim in args.head_dim:
        for n in args.decode_n:
            for batch in args.decode_batch:
                cfg = DecodeConfig(n, batch, args.heads, args.kv_heads, dim, DTYPES[args.dtype], device)
                t0 = time.perf_counter()
                results.append(run_decode_config(cfg, decode_names, args, save))
                save()
                print(f"decode N={n} B={batch} D={dim} done in {time.perf_counter() - t0:.0f} s",
                      flush=True)
    print_results(results, args, env)
    save()
    if args.markdown:
        Path(args.markdown).write_text(markdown_report(results, args, env))
    if args.quick:
        failed = failed_checks(results)
        for line in failed:
            print(f"CHECK FAILED: {line}")
        return 1 if failed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
