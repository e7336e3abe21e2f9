"""CPU benchmark: an eager attention() call through the autograd Function, as eager calls run,
against the same call through the custom op <OP_NAME>_fwd, as it runs in a selective activation
checkpoint's region (docs/architecture.md, "Selective activation checkpointing"). Why eager
calls elsewhere keep the Function: the op's dispatch is not free at small shapes.

    python benchmarks/sac_overhead.py            # the three shapes below, one thread
    python benchmarks/sac_overhead.py --runs 5   # fewer alternating runs

Shapes (B x H x Nq x Nk x D, the Gaussian prior, learnable sigma): a decode step without
gradients, a small training step and a larger one (forward + backward). Each run times a batch
of calls by the Function, then by the op; the medians over the runs are printed.
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
SHAPES = (("decode, no grad", (1, 8, 1, 128, 64), False, 200),
          ("training step", (1, 4, 32, 32, 32), True, 200),
          ("training step", (2, 8, 256, 256, 64), True, 5))


def timed_calls(module, shape, grad, calls):
    """Microseconds per call (forward, and backward where grad) of the given shape."""
    B, H, Nq, Nk, D = shape
    q = torch.randn(B, H, Nq, D, requires_grad=grad)
    k, v = (torch.randn(B, H, Nk, D, requires_grad=grad) for _ in range(2))
    sigma = torch.full((H,), 3.0, requires_grad=grad)
    start = time.perf_counter()
    for _ in range(calls):
        out = module.attention(q, k, v, sigma=sigma, mu=0.0, causal=Nq > 1, q_offset=Nk - Nq)
        if grad:
            out.sum().backward()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="alternating runs per shape")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    module = importlib.import_module("generated.gaussian")
    from bamgen.runtime import ops
    by_function = ops.through_ops

    def through(op):
        ops.through_ops = (lambda q: True) if op else by_function

    torch.manual_seed(0)
    torch.set_num_threads(1)
    for name, shape, grad, calls in SHAPES:
        times = {False: [], True: []}
        for run in range(args.runs + 1):
            for op in (False, True):
                through(op)
                spent = timed_calls(module, shape, grad, calls)
                if run:   # (the first run warms up)
                    times[op].append(spent)
        through(False)
        function, op = (statistics.median(times[k]) for k in (False, True))
        print(f"{name} {'x'.join(map(str, shape))}: Function {function:.0f} us, "
              f"custom op {op:.0f} us ({100 * (op - function) / function:+.0f}%)")


if __name__ == "__main__":
    main()
