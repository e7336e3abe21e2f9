"""CPU benchmark of packed documents: one call over packed documents (cu_seqlens) against the
same documents as separate calls and against one causal call over the whole packed length.

    python benchmarks/packed.py                  # 8 documents of 512 tokens, H=8, D=64, fp32
    python benchmarks/packed.py --docs 16 --length 256
    python benchmarks/packed.py --docs 115 --min-length 16 --length 64 --heads 4 --dim 16
                                                 # many short documents of random lengths
    python benchmarks/packed.py --quick          # tiny smoke run (tests/runtime/test_masks.py)

Peers (forward + backward, learnable prior parameters; one process, run alternately, medians):

* ``packed``    one call with cu_seqlens_q = cu_seqlens_k: each query sees its own document.
* ``separate``  one call per document (what a user without varlen writes; same work, more calls).
* ``one-causal`` one causal call over the whole packed length, as if it were one document: what
                packing without a document mask costs (and it attends across documents).

The work of ``packed`` is the sum of squared document lengths, not the packed length squared:
with D equal documents it should take about 1/D of ``one-causal``'s time, and about
``separate``'s.
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PEERS = ("packed", "separate", "one-causal")


def _module(name):
    sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"generated.{name}")


def _lengths(args):
    """Document lengths: all args.length, or uniform in [min_length, length] (seeded)."""
    if args.min_length is None:
        return [args.length] * args.docs
    gen = torch.Generator().manual_seed(1)
    return torch.randint(args.min_length, args.length + 1, (args.docs,), generator=gen).tolist()


def _inputs(args, gen):
    total = sum(_lengths(args))
    q, k, v, dout = (torch.randn(1, args.heads, total, args.dim, generator=gen) for _ in range(4))
    return q, k, v, dout


def _step(mod, params, q, k, v, dout, **kw):
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    ps = {n: t.detach().clone().requires_grad_(n in mod.LEARNABLE) for n, t in params.items()}
    out = mod.attention(*leaves, **ps, backend="torch", **kw)
    out.backward(dout)


def _peer_fn(peer, mod, params, tensors, args):
    q, k, v, dout = tensors
    lengths = _lengths(args)
    bounds = [0] + torch.tensor(lengths).cumsum(0).tolist()
    cu = torch.tensor(bounds, dtype=torch.int32)
    if peer == "packed":
        return lambda: _step(mod, params, q, k, v, dout, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    if peer == "one-causal":
        return lambda: _step(mod, params, q, k, v, dout, causal=True)

    def separate():
        for a, b in zip(bounds[:-1], bounds[1:]):
            _step(mod, params, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], dout[:, :, a:b], causal=True)
    return separate


def _time(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(args):
    gen = torch.Generator().manual_seed(0)
    tensors = _inputs(args, gen)
    rows = []
    for prior in args.priors:
        mod = _module(prior)
        params = mod.default_params(args.heads)
        fns = {p: _peer_fn(p, mod, params, tensors, args) for p in PEERS}
        for fn in fns.values():     # warm-up
            fn()
        times = {p: [] for p in PEERS}
        for _ in range(args.reps):  # alternate: one repeat of every peer, then the next
            for p in PEERS:
                times[p].append(_time(fns[p]))
        rows.append((prior, {p: statistics.median(t) for p, t in times.items()}))
    return rows


def print_table(rows, args):
    total = sum(_lengths(args))
    shape = (f"{args.length} tokens" if args.min_length is None
             else f"{args.min_length}-{args.length} tokens (random)")
    print(f"packed documents, CPU, torch {torch.__version__}, {torch.get_num_threads()} threads: "
          f"{args.docs} documents x {shape} (packed length {total}), H={args.heads}, "
          f"D={args.dim}, fp32, causal, forward + backward, median of {args.reps}")
    print()
    print("| prior | packed ms | separate ms | one-causal ms | packed / separate | packed / one-causal |")
    print("|---|---:|---:|---:|---:|---:|")
    for prior, t in rows:
        print(f"| {prior} | {t['packed'] * 1e3:.1f} | {t['separate'] * 1e3:.1f} | {t['one-causal'] * 1e3:.1f} "
              f"| {t['packed'] / t['separate']:.2f} | {t['packed'] / t['one-causal']:.2f} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--length", type=int, default=512, help="document length (the longest with --min-length)")
    ap.add_argument("--min-length", type=int, default=None, help="random lengths from this to --length")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--priors", nargs="*", default=["generalized_gaussian", "laplace"])
    ap.add_argument("--quick", action="store_true", help="tiny smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.docs, args.length, args.heads, args.dim, args.reps = 3, 16, 2, 8, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    print_table(run(args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
