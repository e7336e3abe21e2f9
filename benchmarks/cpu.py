"""CPU benchmark of the generated torch path against its peers.

    python benchmarks/cpu.py                      # N = 1024 2048 4096 8192, H=8, D=64, causal, fp32
    python benchmarks/cpu.py --quick              # tiny smoke run (used by tests/runtime/test_cpu_path.py)
    python benchmarks/cpu.py --memory-scaling     # peak memory of fwd+bwd up to N=16384
    python benchmarks/cpu.py --decode             # one decode step (1 query, N cached keys)
    python benchmarks/cpu.py --field              # t5, fire, sandwich against GGD and their
                                                  # materialised biases, N = 1024 4096
    python benchmarks/cpu.py --positions          # FoX (forget_gate over position tensors, the
                                                  # gates' gradients included) against FoX
                                                  # materialised and the prior on token offsets

Peers, all in one process, run alternately (one repeat of every peer, then the next repeat) and
reported as medians, so that load from other processes on a shared machine hits them alike:

* ``sdpa``       torch.nn.functional.scaled_dot_product_attention, causal, no bias: the floor.
* ``bias+sdpa``  the common approach: the generalized-Gaussian bias materialised as an [H, N, N]
                 float tensor from (alpha, beta, mu) with autograd, passed to SDPA as attn_mask
                 (with BAM's epsilon, |d - mu| + 1e-5, or the beta gradient is NaN at d = mu).
* ``bamgen-ggd`` generated/generalized_gaussian.py, learnable alpha, beta, mu (gradients included).
* ``bamgen-laplace`` generated/laplace.py, learnable b.
* ``flex``       torch.compile(flex_attention) with the same prior as a score_mod and a causal
                 block mask, forward only (FlexAttention has no CPU backward); compile time is the
                 first call's time minus a steady call.

Peak memory: torch has no allocator statistics for CPU tensors (and tracemalloc does not see
them), so every (peer, N) runs once more in a fresh subprocess with glibc's mmap threshold fixed
at 64 KiB (MALLOC_MMAP_THRESHOLD_, so a freed tensor goes back to the OS at once): inputs are made,
one warm-up call runs, the kernel's peak-RSS counter is reset (``echo 5 > /proc/self/clear_refs``)
and the peak RSS (VmHWM) during one more call, minus the RSS before it, is reported.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------
# the peers


def _load_generated(name: str, module_dir: str | None):
    if module_dir:
        import importlib.util
        spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(module_dir) / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    sys.path.insert(0, str(ROOT))
    import importlib
    return importlib.import_module(f"generated.{name}")


def _ggd_bias(n: int, alpha, beta, mu, causal: bool):
    i = torch.arange(n, dtype=torch.float32)
    d = i[:, None] - i[None, :]
    bias = -((torch.abs(d - mu[:, None, None]) + 1e-5) / alpha[:, None, None]) ** beta[:, None, None]
    if causal:
        bias = bias.masked_fill(d < 0, -math.inf)
    return bias


class Problem:
    """Inputs of one configuration; ``run(peer, backward)`` calls a peer once."""

    def __init__(self, n: int, heads: int, dim: int, dtype: torch.dtype, module_dir: str | None,
                 causal: bool = True, overrides: dict | None = None):
        self.n, self.heads, self.dim, self.dtype, self.causal = n, heads, dim, dtype, causal
        g = torch.Generator().manual_seed(0)
        self.q, self.k, self.v = (torch.randn(1, heads, n, dim, generator=g).to(dtype).requires_grad_()
                                  for _ in range(3))
        self.dout = torch.randn(1, heads, n, dim, generator=g).to(dtype)
        self.ggd = _load_generated("generalized_gaussian", module_dir)
        self.laplace = _load_generated("laplace", module_dir)
        for name, value in (overrides or {}).items():   # the CPU path's constants: the runtime's
            from bamgen.runtime.cpu import common
            setattr(common, name, value)
        self.ggd_params = {k: t.clone().requires_grad_() for k, t in self.ggd.default_params(heads).items()}
        self.laplace_params = {k: t.clone().requires_grad_()
                               for k, t in self.laplace.default_params(heads).items()}
        self._flex = None
        self.compile_s = None

    def leaves(self):
        return [self.q, self.k, self.v, *self.ggd_params.values(), *self.laplace_params.values()]

    def _clear(self):
        for t in self.leaves():
            t.grad = None

    def flex(self):
        """Compile on first use; returns the compiled callable."""
        if self._flex is None:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            p = {k: t.detach() for k, t in self.ggd_params.items()}
            alpha, beta, mu = p["alpha"], p["beta"], p["mu"]

            def score_mod(score, b, h, qi, kj):
                d = (qi - kj).to(torch.float32)
                return score - torch.pow(torch.abs(d - mu[h]) / alpha[h], beta[h])

            def causal(b, h, qi, kj):
                return kj <= qi

            mask = create_block_mask(causal, None, None, self.n, self.n, device="cpu")
            compiled = torch.compile(flex_attention)
            q, k, v = (t.detach() for t in (self.q, self.k, self.v))
            self._flex = lambda: compiled(q, k, v, score_mod=score_mod, block_mask=mask)
        return self._flex

    def run(self, peer: str, backward: bool):
        self._clear()
        q, k, v = self.q, self.k, self.v
        with torch.set_grad_enabled(backward):
            if peer == "sdpa":
                out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
            elif peer == "bias+sdpa":
                p = self.ggd_params
                bias = _ggd_bias(self.n, p["alpha"], p["beta"], p["mu"], self.causal)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None].to(q.dtype))
            elif peer == "bamgen-ggd":
                out = self.ggd.attention(q, k, v, **self.ggd_params, causal=self.causal)
            elif peer == "bamgen-laplace":
                out = self.laplace.attention(q, k, v, **self.laplace_params, causal=self.causal)
            elif peer == "flex":
                if backward:
                    raise ValueError("flex has no CPU backward")
                with torch.no_grad():
                    out = self.flex()()
            else:
                raise ValueError(peer)
            if backward:
                out.backward(self.dout)
        return out


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# peak memory in a fresh process


def _status(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) * 1024


def _measure_memory_child(args) -> None:
    """Runs in the subprocess: prints {"peak": bytes} for one (peer, N, pass)."""
    torch.set_num_threads(args.threads or torch.get_num_threads())
    prob = Problem(args.child_n, args.heads, args.dim, _DTYPES[args.dtype], args.module_dir,
                   overrides=_overrides(args))
    backward = args.child_pass == "fwd+bwd"
    prob.run(args.child_peer, backward)  # warm-up (flex: compile)
    prob._clear()  # the warm-up's .grad tensors would be freed inside the measured call
    gc.collect()
    base = _status("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as err:
        print(json.dumps({"error": f"cannot reset the peak RSS counter: {err}"}))
        return
    prob.run(args.child_peer, backward)
    print(json.dumps({"peak": _status("VmHWM") - base}))


def measure_memory(peer: str, n: int, backward: bool, args) -> float | None:
    """Peak extra bytes of one call, or None if the subprocess failed."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", "--child-peer", peer,
           "--child-n", str(n), "--child-pass", "fwd+bwd" if backward else "fwd",
           "--heads", str(args.heads), "--dim", str(args.dim), "--dtype", args.dtype]
    if args.module_dir:
        cmd += ["--module-dir", args.module_dir]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    for item in args.set or []:
        cmd += ["--set", item]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    for line in res.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            data = json.loads(line)
            return data.get("peak")
    sys.stderr.write(f"memory run {peer} N={n} failed:\n{res.stderr[-2000:]}\n")
    return None


# --------------------------------------------------------------------------------------------
# the benchmark


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _overrides(args) -> dict:
    """--set NAME=INT: the CPU path's constants (bamgen/runtime/cpu/common.py) such as
    TORCH_TABLE_BLOCK_N, for sweeps."""
    out = {}
    for item in args.set or []:
        name, _, value = item.partition("=")
        out[name] = int(value)
    return out


def native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


def bias_bytes(n: int, heads: int) -> int:
    """What the common approach holds at once in fwd+bwd, roughly: the bias, its autograd
    intermediates and SDPA's math-path attention weights, about six [H, N, N] fp32 tensors."""
    return 6 * heads * n * n * 4


def run_config(n: int, args, peers: list[str]) -> dict:
    prob = Problem(n, args.heads, args.dim, _DTYPES[args.dtype], args.module_dir,
                   overrides=_overrides(args))
    results: dict = {"N": n, "time": {}, "mem": {}}
    passes = [(p, False) for p in peers] + [(p, True) for p in peers if p != "flex"]
    if "flex" in peers:
        t0 = time.perf_counter()
        prob.run("flex", False)
        first = time.perf_counter() - t0
        steady = _time(lambda: prob.run("flex", False))
        results["flex_compile_s"] = max(0.0, first - steady)
    for peer, bwd in passes:  # warm-up
        prob.run(peer, bwd)
    samples = {key: [] for key in passes}
    for _ in range(args.reps):
        for peer, bwd in passes:
            gc.collect()
            samples[(peer, bwd)].append(_time(lambda: prob.run(peer, bwd)))
    for (peer, bwd), ts in samples.items():
        results["time"][(peer, bwd)] = statistics.median(ts)
    # agreement of the generated module with the materialised reference (forward)
    if "bias+sdpa" in peers:
        with torch.no_grad():
            ref = prob.run("bias+sdpa", False).float()
            got = prob.run("bamgen-ggd", False).float()
            results["max_abs_diff_vs_bias_sdpa"] = (got - ref).abs().max().item()
    if "flex" in peers:
        with torch.no_grad():
            results["max_abs_diff_vs_flex"] = (prob.run("bamgen-ggd", False).float()
                                               - prob.run("flex", False).float()).abs().max().item()
    del prob
    gc.collect()
    if args.memory:
        for peer, bwd in passes:
            if args.quick and (peer, bwd) not in (("sdpa", True), ("bamgen-ggd", True)):
                continue  # the smoke run measures one pair only
            results["mem"][(peer, bwd)] = measure_memory(peer, n, bwd, args)
    return results


def _ms(x):
    return "-" if x is None else f"{x * 1e3:.0f}"


def _mb(x):
    return "-" if x is None else f"{x / 2**20:.0f}"


def _ratio(a, b):
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def print_tables(all_results: list[dict], peers: list[str], args) -> None:
    print(f"\nH={args.heads} D={args.dim} B=1 causal {args.dtype}, threads={torch.get_num_threads()}, "
          f"median of {args.reps} alternating repeats; times in ms, peak memory in MiB over the inputs\n")
    print("| N | peer | fwd ms | fwd+bwd ms | peak MiB fwd | peak MiB fwd+bwd |")
    print("|---|---|---|---|---|---|")
    for r in all_results:
        for peer in peers:
            t, m = r["time"], r["mem"]
            print(f"| {r['N']} | {peer} | {_ms(t.get((peer, False)))} | {_ms(t.get((peer, True)))} | "
                  f"{_mb(m.get((peer, False)))} | {_mb(m.get((peer, True)))} |")
    print("\nRatios (target: fwd+bwd / SDPA <= 2, bias+SDPA / bamgen >= 4, fwd / flex <= 1, "
          "memory / SDPA <= 1.5)\n")
    print("| N | ggd/sdpa fwd | ggd/sdpa fwd+bwd | laplace/sdpa fwd+bwd | bias+sdpa/ggd fwd+bwd | "
          "ggd/flex fwd | flex compile s | mem ggd/sdpa fwd+bwd |")
    print("|---|---|---|---|---|---|---|---|")
    for r in all_results:
        t, m = r["time"], r["mem"]
        g = lambda p, b: t.get((p, b))
        comp = r.get("flex_compile_s")
        print(f"| {r['N']} | {_ratio(g('bamgen-ggd', False), g('sdpa', False))} | "
              f"{_ratio(g('bamgen-ggd', True), g('sdpa', True))} | "
              f"{_ratio(g('bamgen-laplace', True), g('sdpa', True))} | "
              f"{_ratio(g('bias+sdpa', True), g('bamgen-ggd', True))} | "
              f"{_ratio(g('bamgen-ggd', False), g('flex', False))} | "
              f"{'-' if comp is None else f'{comp:.0f}'} | "
              f"{_ratio(m.get(('bamgen-ggd', True)), m.get(('sdpa', True)))} |")
    for r in all_results:
        extra = {k: f"{v:.2e}" for k, v in r.items() if k.startswith("max_abs_diff")}
        if extra:
            print(f"N={r['N']}: " + ", ".join(f"{k} {v}" for k, v in extra.items()))


def memory_scaling(args) -> None:
    ns = args.n or [1024, 2048, 4096, 8192, 16384]
    peers = ["sdpa", "bamgen-ggd"]
    print(f"\nPeak memory of fwd+bwd over the inputs (MiB), H={args.heads} D={args.dim} causal "
          f"{args.dtype}; an [H, N, N] fp32 bias alone would be H*N*N*4 bytes\n")
    print("| N | sdpa | bamgen-ggd | ggd / sdpa | ggd bytes / N | [H,N,N] bias |")
    print("|---|---|---|---|---|---|")
    for n in ns:
        row = {p: measure_memory(p, n, True, args) for p in peers}
        ggd = row["bamgen-ggd"]
        per_n = "-" if ggd is None else f"{ggd / n / 1024:.1f} KiB"
        print(f"| {n} | {_mb(row['sdpa'])} | {_mb(ggd)} | {_ratio(ggd, row['sdpa'])} | {per_n} | "
              f"{args.heads * n * n * 4 / 2**20:.0f} |", flush=True)


def decode_benchmark(args) -> None:
    """One decode step: a single query row against N cached keys (q_offset = N - 1, causal), no
    gradient, as generation runs it; against SDPA on the same shape (no bias). "kernel" is the
    fused kernel bamgen's step calls, alone, with GGD's bias mask made beforehand: what a step
    would cost with no Python around it. Alternating repeats, medians (microseconds)."""
    sys.path.insert(0, str(ROOT))
    from bamgen.runtime.cpu.common import FLASH_CPU
    from bamgen.runtime.cpu.decode import decode_mask
    from bamgen.runtime.params import theta as make_theta
    ns = args.n or [1024, 4096, 16384]
    peers = ["sdpa", "kernel", "bamgen-ggd", "bamgen-laplace"]
    modules = {"bamgen-ggd": _load_generated("generalized_gaussian", args.module_dir),
               "bamgen-laplace": _load_generated("laplace", args.module_dir)}
    reps = max(args.reps, 3) * 20
    print(f"decode step, CPU, torch {torch.__version__}, threads {torch.get_num_threads()}: "
          f"B=1, H={args.heads}, D={args.dim}, fp32, one query against N keys, median of {reps} "
          f"alternating repeats")
    print()
    print("| N | sdpa us | kernel us | bamgen-ggd us | bamgen-laplace us | kernel / sdpa | ggd / sdpa "
          "| laplace / sdpa |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for n in ns:
        q = torch.randn(1, args.heads, 1, args.dim, generator=gen)
        k, v = (torch.randn(1, args.heads, n, args.dim, generator=gen) for _ in range(2))
        params = {p: m.default_params(args.heads) for p, m in modules.items()}
        ggd = modules["bamgen-ggd"]
        theta = make_theta(ggd.TRAITS, q, params["bamgen-ggd"], grad=False)
        mask = decode_mask(ggd._prior, theta, args.heads, 1, 1, n, n - 1, 0, True)[0]
        calls = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
                 "kernel": lambda: FLASH_CPU(q, k, v, attn_mask=mask, scale=args.dim ** -0.5)}
        for p, m in modules.items():
            calls[p] = (lambda m=m, prm=params[p]: m.attention(q, k, v, **prm, causal=True,
                                                                 q_offset=n - 1, backend="torch"))
        times = {p: [] for p in peers}
        with torch.no_grad():
            for fn in calls.values():       # warm-up
                fn()
            for _ in range(reps):
                for p in peers:
                    t0 = time.perf_counter()
                    calls[p]()
                    times[p].append(time.perf_counter() - t0)
        med = {p: statistics.median(t) * 1e6 for p, t in times.items()}
        print(f"| {n} | {med['sdpa']:.0f} | {med['kernel']:.0f} | {med['bamgen-ggd']:.0f} | "
              f"{med['bamgen-laplace']:.0f} | {med['kernel'] / med['sdpa']:.2f} | "
              f"{med['bamgen-ggd'] / med['sdpa']:.2f} | {med['bamgen-laplace'] / med['sdpa']:.2f} |",
              flush=True)


# --------------------------------------------------------------------------------------------
# the field's priors (--field): each against its bias materialised as an [H, N, N] tensor from
# the same parameters (with autograd) and passed to SDPA, the way their papers' code runs them


def _t5_bias(n, w):
    """transformers' causal T5 buckets (32, max distance 128) gathered from w [H, 32]."""
    i = torch.arange(n)
    r = (i[:, None] - i[None, :]).clamp(min=0)
    large = 16 + (torch.log(r.float().clamp(min=1) / 16) / math.log(128 / 16) * 16).long()
    bucket = torch.where(r < 16, r, large.clamp(max=31))
    return w[:, bucket]


def _fire_bias(n, c, L, w1, b1, w2, b2):
    """FIRE's MLP over psi(i - j) / psi(max(i, L)), psi(x) = log(c|x| + 1), for every (i, j)
    (c and L are shared: default_params repeats them per head)."""
    c, L = c.reshape(-1)[0], L.reshape(-1)[0]
    i = torch.arange(n, dtype=torch.float32)
    x = torch.log(c * (i[:, None] - i[None, :]).abs() + 1) / torch.log(c * torch.maximum(i, L) + 1)[:, None]
    hidden = torch.relu(x[..., None] * w1 + b1)                  # [N, N, 32]
    return (hidden @ w2.T + b2).permute(2, 0, 1)                 # [H, N, N]


def _sandwich_bias(n, a):
    """a[h] * sum_{k=1..64} cos(d / 10000^(2k/128))."""
    i = torch.arange(n, dtype=torch.float32)
    d = i[:, None] - i[None, :]
    waves = torch.cos(d[..., None] / 10000 ** (2 * torch.arange(1, 65) / 128)).sum(-1)
    return a[:, None, None] * waves


FIELD = {"t5": _t5_bias, "fire": _fire_bias, "sandwich": _sandwich_bias}


def field_benchmark(args) -> None:
    """t5, fire and sandwich (bamgen's CPU path) against GGD and against their materialised
    biases, forward + backward with every parameter learnable, medians of alternating repeats."""
    ns = args.n or [1024, 4096]
    heads, dim = args.heads, args.dim
    print(f"\nThe field's priors, H={heads} D={dim} B=1 causal fp32, threads={torch.get_num_threads()}, "
          f"fwd+bwd ms, median of {args.reps} alternating repeats\n")
    print("| N | prior | bamgen | materialised bias + SDPA | bias / bamgen | bamgen / GGD | max abs diff |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for n in ns:
        g = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(1, heads, n, dim, generator=g) for _ in range(4))
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        calls = {}
        for name in ("generalized_gaussian", *FIELD):
            module = _load_generated(name, args.module_dir)
            torch.manual_seed(0)
            params = {key: t.clone().requires_grad_() for key, t in module.default_params(heads).items()}
            calls[(name, "bamgen")] = lambda m=module, p=params: m.attention(q, k, v, **p, causal=True)
            if name in FIELD:
                def materialised(p=params, make=FIELD[name]):
                    bias = make(n, *p.values()).masked_fill(~causal, -math.inf)
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None])
                calls[(name, "bias")] = materialised
        leaves = [q, k, v]
        for t in leaves:
            t.requires_grad_()

        def step(call):
            out = call()
            out.backward(dout)
            for t in leaves:
                t.grad = None

        t = alternating_medians(calls, step, args.reps)
        ggd = t[("generalized_gaussian", "bamgen")]
        print(f"| {n} | ggd | {_ms(ggd)} | - | - | 1.00 | - |", flush=True)
        for name in FIELD:
            ours, bias = t[(name, "bamgen")], t[(name, "bias")]
            with torch.no_grad():   # the peers compute the same attention
                diff = (calls[(name, "bamgen")]() - calls[(name, "bias")]()).abs().max().item()
            print(f"| {n} | {name} | {_ms(ours)} | {_ms(bias)} | {_ratio(bias, ours)} | "
                  f"{_ratio(ours, ggd)} | {diff:.1e} |", flush=True)


def alternating_medians(calls: dict, step, reps: int) -> dict:
    """{key: median seconds of step(call)}: one warm-up call each, then `reps` rounds in which
    every call takes its turn (garbage collected before each), as the other tables here."""
    for call in calls.values():
        step(call)
    samples = {key: [] for key in calls}
    for _ in range(reps):
        for key, call in calls.items():
            gc.collect()
            samples[key].append(_time(lambda: step(call)))
    return {key: statistics.median(ts) for key, ts in samples.items()}


# positions as tensors (--positions): the Forgetting Transformer three ways


def positions_benchmark(args) -> None:
    """FoX forward + backward, the gates learnable: bamgen's forget_gate over pos_q = pos_k =
    logsigmoid(gates).cumsum(-1) [B, H, N] (the positions' gradients flow back to the gates),
    against FoX written in PyTorch (the bias c_i - c_j materialised [B, H, N, N] and passed to
    SDPA, the usual way), and against the same prior on integer token offsets (no position
    tensors: the distance-table path). Medians of alternating repeats."""
    ns = args.n or [1024, 4096]
    heads, dim = args.heads, args.dim
    fox = _load_generated("forget_gate", args.module_dir)
    print(f"\nPositions as tensors: FoX, H={heads} D={dim} B=1 causal fp32, "
          f"threads={torch.get_num_threads()}, fwd+bwd ms, median of {args.reps} alternating repeats\n")
    print("| N | bamgen, positions (gates' grads) | materialised FoX + SDPA | the prior on offsets "
          "| materialised / bamgen | positions / offsets | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n in ns:
        g = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(1, heads, n, dim, generator=g) for _ in range(4))
        gates = (torch.randn(1, heads, n, generator=g) + 3.0).requires_grad_()
        causal = torch.ones(n, n, dtype=torch.bool).tril()

        def positions():
            c = F.logsigmoid(gates).cumsum(-1)
            return fox.attention(q, k, v, causal=True, pos_q=c, pos_k=c)

        def materialised():
            c = F.logsigmoid(gates).cumsum(-1)
            bias = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, -math.inf)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

        def offsets():
            return fox.attention(q, k, v, causal=True)

        calls = {"positions": positions, "materialised": materialised, "offsets": offsets}
        leaves = [q, k, v, gates]
        for t in leaves[:3]:
            t.requires_grad_()

        def step(call):
            call().backward(dout)
            for t in leaves:
                t.grad = None

        t = alternating_medians(calls, step, args.reps)
        with torch.no_grad():
            diff = (positions() - materialised()).abs().max().item()
        print(f"| {n} | {_ms(t['positions'])} | {_ms(t['materialised'])} | {_ms(t['offsets'])} | "
              f"{_ratio(t['materialised'], t['positions'])} | {_ratio(t['positions'], t['offsets'])} "
              f"| {diff:.1e} |", flush=True)


    integer_positions_benchmark(args, ns)


def integer_positions_benchmark(args, ns) -> None:
    """GGD over randomized integer positions (sorted random integers from a range 4x the
    length, Ruoss et al.), forward + backward with the parameters' gradients: the CPU path's
    distance table read at d = i - j, against the same call evaluating the prior per score (the
    table switched off) and against GGD on token offsets."""
    from bamgen.runtime.cpu import backward as cpu_backward, forward as cpu_forward
    ggd = _load_generated("generalized_gaussian", args.module_dir)
    heads, dim = args.heads, args.dim
    print(f"\nInteger positions: GGD, H={heads} D={dim} B=1 causal fp32, fwd+bwd ms, median of "
          f"{args.reps} alternating repeats\n")
    print("| N | table at d = i - j | per score | offsets | per score / table | table / offsets "
          "| max abs diff (table, per score) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    real = cpu_forward.position_tables, cpu_backward.position_tables
    for n in ns:
        g = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(1, heads, n, dim, generator=g).requires_grad_() for _ in range(4))
        pos = torch.sort(torch.randperm(4 * n, generator=g)[:n]).values[None]
        params = {name: t.requires_grad_() for name, t in ggd.default_params(heads).items()}

        def table_off(off):
            value = (lambda *a: None) if off else None
            cpu_forward.position_tables = value or real[0]
            cpu_backward.position_tables = value or real[1]

        def step(call):
            call().backward(dout)
            for t in (q, k, v, *params.values()):
                t.grad = None

        calls = {
            "table": lambda: (table_off(False), ggd.attention(q, k, v, **params, causal=True, pos_q=pos, pos_k=pos))[1],
            "per score": lambda: (table_off(True), ggd.attention(q, k, v, **params, causal=True, pos_q=pos, pos_k=pos))[1],
            "offsets": lambda: (table_off(False), ggd.attention(q, k, v, **params, causal=True))[1]}
        try:
            t = alternating_medians(calls, step, args.reps)
            with torch.no_grad():   # the two ways compute the same attention
                diff = (calls["table"]() - calls["per score"]()).abs().max().item()
        finally:
            table_off(False)
        print(f"| {n} | {_ms(t['table'])} | {_ms(t['per score'])} | {_ms(t['offsets'])} | "
              f"{_ratio(t['per score'], t['table'])} | {_ratio(t['table'], t['offsets'])} | "
              f"{diff:.1e} |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="*", help="sequence lengths (default 1024 2048 4096 8192)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", choices=list(_DTYPES), default="fp32",
                    help="bf16 runs only where the CPU has native bf16 (avx512_bf16/amx) unless forced")
    ap.add_argument("--force-bf16", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--peers", nargs="*", default=None,
                    help="subset of: sdpa bias+sdpa bamgen-ggd bamgen-laplace flex")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile is slow)")
    ap.add_argument("--no-memory", dest="memory", action="store_false")
    ap.add_argument("--bias-max-n", type=int, default=4096,
                    help="largest N for bias+sdpa (it holds several [H, N, N] tensors)")
    ap.add_argument("--memory-scaling", action="store_true")
    ap.add_argument("--decode", action="store_true",
                    help="one decode step (1 query against N keys) against SDPA (default N 1024 4096 16384)")
    ap.add_argument("--field", action="store_true",
                    help="t5, fire, sandwich against GGD and their materialised biases (default N 1024 4096)")
    ap.add_argument("--positions", action="store_true",
                    help="FoX over position tensors against FoX materialised and the prior on offsets")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run")
    ap.add_argument("--module-dir", default=None, help="load the generated modules from this folder")
    ap.add_argument("--set", action="append", metavar="NAME=INT",
                    help="override a constant of the CPU path (e.g. TORCH_TABLE_BLOCK_N=1024)")
    # internal: one memory measurement in a subprocess
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-peer", help=argparse.SUPPRESS)
    ap.add_argument("--child-n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-pass", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args._child:
        _measure_memory_child(args)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dtype == "bf16" and not (native_bf16() or args.force_bf16):
        print(f"bf16: skipped, this CPU has no native bf16 ({torch.backends.cpu.get_cpu_capability()}); "
              "--force-bf16 runs it anyway")
        return 0
    if args.memory_scaling:
        memory_scaling(args)
        return 0
    if args.decode:
        if args.quick:
            args.n, args.reps = args.n or [64], 1
        decode_benchmark(args)
        return 0
    if args.field:
        if args.quick:
            args.n, args.reps = args.n or [64], 1
        field_benchmark(args)
        return 0
    if args.positions:
        if args.quick:
            args.n, args.reps = args.n or [64], 1
        positions_benchmark(args)
        return 0
    if args.quick:
        args.n = args.n or [256]
        args.reps = 2
        args.no_flex = True
    ns = args.n or [1024, 2048, 4096, 8192]
    peers = args.peers or ["sdpa", "bias+sdpa", "bamgen-ggd", "bamgen-laplace", "flex"]
    if args.no_flex and "flex" in peers:
        peers.remove("flex")
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
          f"{os.cpu_count()} CPUs, threads {torch.get_num_threads()}", flush=True)
    all_results = []
    for n in ns:
        config_peers = [p for p in peers if p != "bias+sdpa" or n <= args.bias_max_n]
        if len(config_peers) < len(peers):
            print(f"N={n}: bias+sdpa skipped (about {bias_bytes(n, args.heads) / 2**30:.0f} GiB; "
                  f"--bias-max-n raises the limit)", flush=True)
        t0 = time.perf_counter()
        all_results.append(run_config(n, args, config_peers))
        print(f"N={n} done in {time.perf_counter() - t0:.0f} s", flush=True)
    print_tables(all_results, peers, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
