"""What a call of the Triton path launches on the device, counted on the CPU: the host's share of
a call's time is paid per launch, before the kernels run.

    python benchmarks/launches.py                         # the representative priors
    python benchmarks/launches.py --priors generalized_gaussian t5 --n 1024

An H200 timed NoPE's forward call at 2.1 ms around a 1.24 ms kernel and GGD's at 4.0 ms around
1.3 ms (docs/performance.md, "Fifth GPU session"); `benchmarks/gpu.py` prints the host time of
one launch on the machine it runs on (`launch_us`). This script counts, for each prior and each
call a user makes (an inference forward, a training step's forward and backward, a generation
step: one row against cached keys), the device operations torch would launch (each ATen
operation that computes or fills a tensor of at least one element, seen through a
TorchDispatchMode; views and allocations launch nothing) and the Triton kernels, with the
Triton launches stubbed so that nothing runs in the interpreter (the count does not depend on
the values) and a GPU family's tiles (--family: how many dQ launches a prior's parameter
gradients take). The inputs are made before the count. Multiplied by a launch's host time, it
is the least host time a call takes on that machine. A table prior's distance table counts as
its two Triton kernels (launch.distance_table; about forty torch operations before them).

Counted on CPU tensors, where the functional API's parameter-domain check remembers values it
has seen: on a GPU it runs each call, a few operations more and one wait for the device
(bamgen.runtime.params.DomainCheck; the nn.Module skips it).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")   # (before triton is imported)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PRIORS = ("uniform", "laplace", "generalized_gaussian", "bam_ssmax", "t5", "forget_gate", "fire")
# ATen operations that make or reshape a tensor without a kernel on a GPU
NO_LAUNCH = {"view", "_unsafe_view", "expand", "unsqueeze", "squeeze", "select", "slice", "t",
             "transpose", "permute", "unbind", "split", "chunk", "detach", "alias", "as_strided",
             "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
             "lift_fresh", "_reshape_alias", "reshape", "_local_scalar_dense", "is_nonzero",
             "sym_size", "sym_stride", "sym_numel", "dim", "size", "stride", "numel", "is_same_size",
             "_has_compatible_shallow_copy_type", "set_"}


class DeviceOps(TorchDispatchMode):
    """Counts the ATen operations that would launch a kernel on a GPU."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        made = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(t, torch.Tensor)]
        if name not in NO_LAUNCH and any(t.numel() for t in made):   # (an empty one: no kernel)
            self.ops[name] += 1
        return out


class CountedLaunches:
    """A launcher (launch.py's wrap: wrap(kernel)[grid](*args)) that launches nothing and counts
    each launch by kernel."""

    def __init__(self):
        self.kernels = collections.Counter()

    def __call__(self, kernel):
        return _Counted(self.kernels, getattr(kernel, "__name__", "?"))


class _Counted:
    def __init__(self, kernels, name):
        self.kernels, self.name = kernels, name

    def __getitem__(self, grid):
        return self.launch

    def launch(self, *args, **kwargs):
        self.kernels[self.name] += 1


@contextlib.contextmanager
def stubbed_launches(counter: CountedLaunches):
    """Within it, every Triton launch of the eager path goes through `counter` instead (the
    launchers' default `wrap`), put back after, and a table prior's distance table is built as
    on a GPU, by the table kernels."""
    from bamgen.runtime.triton import launch
    fns = (launch.forward_kernels, launch.decode, launch.backward_kernels, launch.distance_table)
    saved = [fn.__defaults__ for fn in fns]
    for fn in fns:
        fn.__defaults__ = fn.__defaults__[:-1] + (counter,)
    try:
        with launch.pinned(table="device"):   # (a GPU's table build; the CPU's is torch's)
            yield
    finally:
        for fn, defaults in zip(fns, saved):
            fn.__defaults__ = defaults


def calls(module, n: int, heads: int = 4, dim: int = 64):
    """{call: a function that makes its inputs and returns the call}: an inference forward, a
    training step (forward and backward, every parameter learnable), a generation step."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, dim, generator=g).to(torch.bfloat16) for _ in range(3))
    params = module.default_params(heads)

    def forward():
        def call():
            with torch.no_grad():
                module.attention(q, k, v, causal=True, backend="triton", **params)
        return call

    def training():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        learn = {name: t.clone().requires_grad_() for name, t in params.items()}
        dout = torch.ones_like(q)

        def call():
            module.attention(*leaves, causal=True, backend="triton", **learn).backward(dout)
        return call

    def generation():
        row = q[:, :, -1:].contiguous()

        def call():
            with torch.no_grad():
                module.attention(row, k, v, causal=True, q_offset=n - 1, backend="triton", **params)
        return call
    return {"forward": forward, "training step": training, "generation step": generation}


@contextlib.contextmanager
def family_tiles(family: str):
    """Within it, the interpreter's launches take `family`'s tiles (BAMGEN_INTERPRET_TILES)."""
    saved = os.environ.get("BAMGEN_INTERPRET_TILES")
    os.environ["BAMGEN_INTERPRET_TILES"] = family
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("BAMGEN_INTERPRET_TILES")
        else:
            os.environ["BAMGEN_INTERPRET_TILES"] = saved


def count(module, n: int, family: str = "sm_90") -> dict:
    """{call: (device operations, Triton launches, {operation: count})} of one call each, with
    `family`'s tiles, after a first call of each (which builds what later calls reuse; its
    launches stubbed too, so that nothing runs in the interpreter)."""
    out = {}
    with family_tiles(family):
        for name, make in calls(module, n).items():
            with stubbed_launches(CountedLaunches()):
                make()()
            call = make()
            counter, ops = CountedLaunches(), DeviceOps()
            with stubbed_launches(counter), ops:
                call()
            out[name] = (sum(ops.ops.values()), sum(counter.kernels.values()), dict(ops.ops))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--priors", nargs="+", default=list(PRIORS), metavar="NAME",
                        help=f"shipped priors (default: {' '.join(PRIORS)})")
    parser.add_argument("--n", type=int, default=256, help="the sequence length (default 256)")
    parser.add_argument("--family", choices=("sm_90", "sm_80"), default="sm_90",
                        help="the GPU family whose tiles the launches take (default sm_90)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import bamgen
    from bamgen.resources import shipped_prior, shipped_priors
    rows = []
    for name in args.priors:
        path = shipped_prior(name)
        if path is None:
            parser.error(f"--priors: {name!r} is not a shipped prior; choose from "
                         f"{', '.join(p.stem for p in shipped_priors())}")
        counts = count(bamgen.load(path), args.n, args.family)
        rows.append((name, counts))
    print(f"Device launches a call, {args.family}'s tiles, N = {args.n}, 4 heads, head dim 64, "
          "bf16, causal (torch operations + Triton kernels):\n")
    names = list(rows[0][1])
    print("| prior | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for name, counts in rows:
        print(f"| {name} | " + " | ".join(f"{ops} + {kernels}" for ops, kernels, _ in counts.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
