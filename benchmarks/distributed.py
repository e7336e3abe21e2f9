"""Context parallelism on the CPU: one long sequence over 1, 2 and 4 gloo processes.

    python benchmarks/distributed.py                 # N = 8192, H = 8, Hk = 2, D = 64, GGD, causal
    python benchmarks/distributed.py --quick         # tiny smoke run
    python benchmarks/distributed.py --documents 8   # 8 equal documents packed (cu_seqlens)

Four processes are started once (spawned, gloo, one torch thread each) and run every
configuration in turns, one repeat of each and then the next round, so that load from other
processes on a shared machine hits them alike:

* ``one process``   `mod.attention` on the whole sequence, in one process with one thread;
* ``one process, 2 threads``  the same with torch's two threads (what one process gets of two cores);
* ``ring W=1``      `ring_attention` over a group of one (the layer's own cost: blocks, merges);
* ``ring W=2``, ``ring W=4``  `shard` -> `ring_attention` -> backward over 2 and 4 ranks.

A repeat is forward + backward (all gradients, the prior's parameters included). A ring's time is
its slowest rank's; every time is the median of the repeats. Memory per rank, the largest over
the ranks, in one more call: "held" is the resident memory over the inputs once the forward has
returned (what a layer keeps until its backward: the output and what autograd saved), "peak" the
most during forward + backward. The processes start with glibc's mmap threshold fixed at 64 KiB
(a freed tensor goes back to the OS at once) and each resets its kernel peak-RSS counter before
the call (``/proc/self/clear_refs``), as benchmarks/cpu.py does. "Sent" is what one rank sends
in one forward and backward (K/V twice, dK/dV once), the largest over the ranks.

Four processes on a two-core machine share the cores two to one: ring W=4 then measures the
memory per rank and the schedule's cost, not a speed-up (see docs/performance.md).
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["one process", "one process, 2 threads", "ring W=1", "ring W=2", "ring W=4"]


def _status(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) * 1024


class _Problem:
    """The inputs of one configuration on this rank and one forward + backward over them."""

    def __init__(self, mod, config, group, args):
        self.mod, self.config, self.group = mod, config, group
        g = torch.Generator().manual_seed(0)
        shape_q = (1, args.heads, args.n, args.dim)
        shape_kv = (1, args.kv_heads, args.n, args.dim)
        q, dout = torch.randn(shape_q, generator=g), torch.randn(shape_q, generator=g)
        k, v = torch.randn(shape_kv, generator=g), torch.randn(shape_kv, generator=g)
        self.params = {n: t.requires_grad_(n in mod.LEARNABLE) for n, t in mod.default_params(args.heads).items()}
        if config.startswith("ring"):
            from bamgen.distributed import shard
            q, k, v, dout = (shard(t, group=group) for t in (q, k, v, dout))
        self.leaves = [t.requires_grad_() for t in (q, k, v)]
        self.dout = dout
        self.docs = {}   # packed documents: each alone (--documents)
        if args.documents > 1:
            cu = torch.linspace(0, args.n, args.documents + 1).round().to(torch.int32)
            self.docs = (dict(cu_seqlens=cu) if config.startswith("ring")
                         else dict(cu_seqlens_q=cu, cu_seqlens_k=cu))
        self.threads = 2 if config.endswith("2 threads") else 1

    def forward(self):
        from bamgen.distributed import ring_attention
        torch.set_num_threads(self.threads)
        if self.config.startswith("ring"):
            return ring_attention(self.mod, *self.leaves, causal=True, group=self.group, **self.docs,
                                  **self.params)
        return self.mod.attention(*self.leaves, causal=True, **self.docs, **self.params)

    def backward(self, out):
        out.backward(self.dout)
        for t in self.leaves + list(self.params.values()):
            t.grad = None
        torch.set_num_threads(1)

    def run(self):
        self.backward(self.forward())

    def measure(self):
        """(bytes held from forward to backward, peak bytes of forward + backward), over the RSS
        before the call."""
        gc.collect()
        base = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        out = self.forward()
        held = _status("VmRSS") - base
        self.backward(out)
        return held, _status("VmHWM") - base


def _participants(config: str) -> int:
    return int(config.split("W=")[1]) if "W=" in config else 1


def _counting_sends(run):
    """Elements sent by this rank's isends during run(), in bytes."""
    sent = []
    real = dist.batch_isend_irecv

    def batch(ops):
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return real(ops)

    dist.batch_isend_irecv = batch
    try:
        run()
    finally:
        dist.batch_isend_irecv = real
    return sum(sent)


def _worker(rank, world, port, args, out_path):
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=1800))
    groups = {w: dist.new_group(list(range(w))) for w in (1, 2, 4)}
    mod = importlib.import_module(f"generated.{args.prior}")
    problems = {}
    for config in CONFIGS:
        if rank < _participants(config):
            problems[config] = _Problem(mod, config, groups[_participants(config)], args)
    times = {c: [] for c in CONFIGS}
    for rep in range(args.reps + 1):             # the first round warms up
        for config in CONFIGS:
            dist.barrier()
            if config in problems:
                t0 = time.perf_counter()
                problems[config].run()
                if rep:
                    times[config].append(time.perf_counter() - t0)
    memory, sent = {}, {}
    for config in CONFIGS:
        dist.barrier()
        if config in problems:
            memory[config] = problems[config].measure()
    for config in CONFIGS:
        dist.barrier()
        if config in problems:
            sent[config] = _counting_sends(problems[config].run)
    results = [None] * world
    dist.all_gather_object(results, {"times": times, "memory": memory, "sent": sent})
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _summary(results):
    """Per config: (median time of the slowest rank, bytes held from forward to backward and
    peak bytes of forward + backward, the largest over the ranks, bytes sent by a rank)."""
    rows = {}
    for config in CONFIGS:
        ranks = [r for r in results if r["times"][config]]
        slowest = [max(r["times"][config][i] for r in ranks) for i in range(len(ranks[0]["times"][config]))]
        rows[config] = (statistics.median(slowest), max(r["memory"][config][0] for r in ranks),
                        max(r["memory"][config][1] for r in ranks), max(r["sent"][config] for r in ranks))
    return rows


def _print(rows, args):
    base_t, base_held, base_peak, _ = rows["one process"]
    docs = f", {args.documents} packed documents" if args.documents > 1 else ""
    print(f"\n{args.prior}, N={args.n}{docs}, H={args.heads}, Hk={args.kv_heads}, D={args.dim}, B=1, causal, "
          f"fp32, forward + backward; median of {args.reps} alternating repeats; {os.cpu_count()} CPUs\n")
    print("| configuration | time ms | time / one process | held fwd->bwd MiB per rank | / one process "
          "| peak MiB per rank | / one process | sent MiB per rank |")
    print("|---|---|---|---|---|---|---|---|")
    for config, (t, held, peak, sent) in rows.items():
        print(f"| {config} | {t * 1e3:.0f} | {_ratio(t, base_t)} | {held / 2**20:.1f} | {_ratio(held, base_held)} | "
              f"{peak / 2**20:.1f} | {_ratio(peak, base_peak)} | {sent / 2**20:.1f} |")


def _ratio(value, base) -> str:
    """value / base, or "-" where the base measured nothing: an RSS delta is 0 when the
    allocator serves a small problem (--quick) from memory it already holds."""
    return f"{value / base:.2f}" if base > 0 else "-"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8192, help="sequence length (a multiple of 8)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--prior", default="generalized_gaussian")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (N=256, 2 repeats)")
    ap.add_argument("--documents", type=int, default=1,
                    help="pack the sequence as this many equal documents (cu_seqlens)")
    args = ap.parse_args(argv)
    if not 1 <= args.documents <= args.n:
        ap.error(f"--documents {args.documents}: must be between 1 and --n ({args.n})")
    if args.quick:
        args.n, args.reps = 256, 2
    if args.n % 8:
        ap.error(f"--n {args.n}: must be a multiple of 8 (2 chunks per rank with 4 ranks)")
    if not Path("/proc/self/clear_refs").exists():
        ap.error("needs Linux (peak memory through /proc/self/clear_refs)")
    os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = Path(tmp) / "results.json"
        t0 = time.perf_counter()
        mp.spawn(_worker, args=(4, port, args, str(out_path)), nprocs=4)
        results = json.loads(out_path.read_text())
    _print(_summary(results), args)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
