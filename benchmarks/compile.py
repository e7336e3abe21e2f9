"""A small decoder's training step on the CPU, eager against torch.compile.

    nice -n 19 python benchmarks/compile.py            # 2 layers, d_model 128, 4 heads, N = 256
    python benchmarks/compile.py --quick               # a smoke run (N = 64, few repeats)

The model: pre-norm decoder blocks (LayerNorm, q/k/v projections, the generalized-Gaussian
module from bamgen.generated, output projection, a 4x MLP), one training step = forward, a
squared loss, backward, SGD update. Peers in one process, run alternately (one step of each,
then the next repeat), medians reported with their ratio to eager:

* ``eager``     the model as written;
* ``compiled``  torch.compile(model, fullgraph=True, dynamic=True) (inductor), warmed up first.

Compile times: the first call at length N (trace + inductor + the backward's compile) and the
first call at a new length N + 37 (a recompile would show here; without one it is a steady step).
Graph and graph-break counts come from torch._dynamo's counters. One torch thread.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch._dynamo.utils import counters

from bamgen.generated import generalized_gaussian as ggd


class Block(torch.nn.Module):
    def __init__(self, d_model, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(d_model), torch.nn.LayerNorm(d_model)
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d_model, 4 * d_model), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d_model, d_model))
        self.attn = ggd.GeneralizedGaussianAttention(heads)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(self.attn(q, k, v, causal=True).transpose(1, 2).reshape(B, N, C))
        return x + self.mlp(self.norm2(x))


class Decoder(torch.nn.Module):
    def __init__(self, layers, d_model, heads):
        super().__init__()
        self.blocks = torch.nn.Sequential(*(Block(d_model, heads) for _ in range(layers)))

    def forward(self, x):
        return self.blocks(x)


def make_step(model, fn):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(x):
        opt.zero_grad(set_to_none=True)
        fn(x).square().mean().backward()
        opt.step()
    return step


def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 64, 3 repeats (smoke run)")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n, repeats = (64, 3) if args.quick else (256, args.repeats)
    batch, d_model, heads, layers = 2, 128, 4, 2

    eager_model, compiled_model = Decoder(layers, d_model, heads), Decoder(layers, d_model, heads)
    compiled_model.load_state_dict(eager_model.state_dict())
    steps = {"eager": make_step(eager_model, eager_model),
             "compiled": make_step(compiled_model, torch.compile(compiled_model, fullgraph=True,
                                                                 dynamic=True))}
    x = torch.randn(batch, n, d_model)
    counters.clear()
    first = timed(steps["compiled"], x)
    new_length = timed(steps["compiled"], torch.randn(batch, n + 37, d_model))
    steps["eager"](x)
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(timed(step, x))
    median = {name: statistics.median(t) for name, t in times.items()}
    steady = median["compiled"]

    print(f"decoder: {layers} layers, d_model {d_model}, {heads} heads, B {batch}, N {n}, "
          f"1 thread, {repeats} alternating repeats")
    print(f"{'peer':<10} {'step ms':>9} {'vs eager':>9}")
    for name in steps:
        print(f"{name:<10} {median[name] * 1e3:>9.1f} {median[name] / median['eager']:>9.2f}")
    print(f"first compiled step (N={n}): {first:.1f} s ({first / steady:.0f} steady steps)")
    print(f"first step at a new length (N={n + 37}): {new_length * 1e3:.1f} ms "
          f"({new_length / steady:.2f} steady steps)")
    print(f"graphs compiled: {counters['stats']['unique_graphs']}, "
          f"graph breaks: {sum(counters['graph_break'].values())}")


if __name__ == "__main__":
    main()
