"""Triton's fused-attention tutorial compiled ahead of time and modelled beside bamgen's NoPE
kernels: the in-Triton floor for NoPE, without a GPU (docs/performance.md, "NoPE against
Triton's tutorial, modelled").

    python benchmarks/tutorial_model.py PATH                         # sm_90 and sm_80, D = 64, 128
    python benchmarks/tutorial_model.py PATH --arch sm_90 --head-dim 128
    python benchmarks/tutorial_model.py PATH --run docs/results/gpu/h200_2026-11-26_tutorial.json \
        --pairs docs/results/gpu/h200_2026-11-26_pairs.json

PATH is a copy of python/tutorials/06-fused-attention.py of the Triton in use (the one
`benchmarks/gpu.py --tutorial` times; it is not shipped). Nothing of it is edited:

* **Its launches, captured.** The tutorial is imported with the GPU's questions answered for
  the target (torch's device capability, which filters its autotune configs, and Triton's
  active target), then its autograd Function's forward and backward run on CPU tensors with
  every Triton kernel of the module replaced by a recorder. Each launch is kept as the tutorial
  makes it: the jit function, its arguments, warps and stages; an autotuned kernel gives one
  launch per config it keeps. A launch's signature and hints are what Triton's launcher derives
  from the values (an integer 1 becomes a constexpr, a multiple of 16 or a 16-byte-aligned
  pointer gets the divisibility hint).
* **Compiled and modelled** like bamgen's kernels (`bamgen.aot.compile_kernel`, `loop_model`):
  registers, stack, shared memory, and the main loop's cycles per 1000 scores. The forward's
  main loop is its unmasked one. The fused backward walks every score twice, in a dK/dV loop
  and in a dQ loop: its cost is the sum of its two unmasked loops. A loop's tile comes from the
  launch's constexprs (BLOCK_M x BLOCK_N; BLOCK_M1 x BLOCK_N1 for dK/dV, BLOCK_M2 x BLOCK_N2
  for dQ), and the loop is the shortest of the kernel's MMA loops (`bamgen.aot.mma_loops`)
  whose tensor-core flops are that tile's: a masked loop walks half tiles or more instructions.
  Preprocessing kernels are left out on both sides.
* **Beside bamgen's NoPE** at the same dtype (fp16, the tutorial's), head dim and architecture:
  the forward's cycles, and dK/dV's plus dQ's. `--run` adds the ratios a GPU measured
  (benchmarks/gpu.py --kernels with the tutorial peer); `--pairs` the fitted model (weights
  fitted to the points of a model_check.py --pairs file: bamgen's kernels), on the tutorial's
  kernels, which the fit never saw.

The autotuner tries every config that compiles and fits (after the kernel's own
``early_config_prune``, applied here too), and keeps the fastest it times; the model's pick is
the config of fewest modelled cycles among those that fit and do not spill, "tied" where others
model the same.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from autotune_names import config_name

if __name__ == "__main__":   # the AOT compile needs the compiler's kernels, not the interpreter's
    os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # Triton's default, as the tutorial runs
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bamgen.aot import ARCHS  # noqa: E402 (the repository's root on the path first)
from model_check import weighted  # noqa: E402

# the largest shared memory one CTA may take (227 KB on an H100, 163 KB on an A100)
SHARED_LIMIT = {"sm_80": 166912, "sm_90": 232448}
# the capture's (batch, heads, N): the H200 run's batch and heads (Triton's launcher hints the
# head count as a multiple of 16, as it did there), N a multiple of 128 (the tutorial's
# backward asks it; a length changes no specialisation past that)
CAPTURE_SHAPE = (2, 16, 256)


class TutorialError(Exception):
    """The file is not a tutorial this tool can read; the message says what it lacks."""


@dataclass(frozen=True)
class Launch:
    """One kernel launch of the tutorial, as Triton would specialise it: the kernel's name,
    its jit function, the signature, constexprs and hints, warps and stages; ``config`` names an
    autotune config ("" for a kernel launched with fixed settings)."""
    kernel: str
    phase: str                      # "fwd" or "bwd": which call of the autograd Function launched it
    fn: object = field(repr=False)
    signature: dict = field(repr=False)
    constexprs: dict
    attrs: dict = field(repr=False)
    warps: int
    stages: int
    config: str = ""


@dataclass(frozen=True)
class Row:
    """One compiled tutorial kernel (one config) with its model."""
    arch: str
    head_dim: int
    phase: str
    kernel: str
    config: str
    registers: int = 0
    stack_bytes: int = 0
    shared_bytes: int = 0
    cycles: float | None = None       # modelled cycles per 1000 scores (None: did not compile)
    note: str = ""
    loops: tuple[int, ...] = ()       # the modelled loops: indices into the kernel's MMA loops
    units: tuple[tuple[str, float], ...] = ()   # each unit's cycles per 1000 scores, loops summed

    @property
    def usable(self) -> bool:
        """Compiles, fits the architecture's shared memory and does not spill."""
        return (self.cycles is not None and not self.stack_bytes
                and self.shared_bytes <= SHARED_LIMIT[self.arch])


# ----------------------------------------------------------------------------------------
# Capture: the tutorial's launches, as it makes them
# ----------------------------------------------------------------------------------------
class _FakeDriver:
    """What the tutorial asks Triton's active driver at import and in its forward."""

    def __init__(self, arch: str):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", ARCHS[arch], 32)

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")

    def get_current_device(self):
        return 0


@contextlib.contextmanager
def _as_target(arch: str):
    """torch's capability and Triton's active driver answer for ``arch``, then are restored."""
    import torch
    from triton.runtime import driver
    capability, active = torch.cuda.get_device_capability, driver._active
    torch.cuda.get_device_capability = lambda *a, **k: divmod(ARCHS[arch], 10)
    driver.set_active(_FakeDriver(arch))
    try:
        yield
    finally:
        torch.cuda.get_device_capability, driver._active = capability, active


def load_tutorial(path: str, arch: str):
    """The tutorial module imported as if on ``arch`` (its autotune filter reads the capability)."""
    spec = importlib.util.spec_from_file_location(f"triton_tutorial_{arch}", path)
    if spec is None:
        raise TutorialError(f"tutorial: {path} is not a Python file (a .py copy of "
                            "python/tutorials/06-fused-attention.py is expected)")
    module = importlib.util.module_from_spec(spec)
    try:
        with _as_target(arch):
            spec.loader.exec_module(module)
    except ImportError as err:
        raise TutorialError(f"tutorial: {path} imports {err.name or err}, which is not installed "
                            "here (pip install it)") from None
    except Exception as err:
        raise TutorialError(f"tutorial: {path} fails at import ({type(err).__name__}: {err})") from None
    if not isinstance(getattr(module, "_attention", None), type):
        raise TutorialError(f"{path}: no _attention autograd Function (a copy of "
                            "python/tutorials/06-fused-attention.py is expected)")
    return module


def _kernels(module) -> dict:
    """The module's Triton kernels: name -> JITFunction or Autotuner."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction
    return {name: obj for name, obj in vars(module).items() if isinstance(obj, (JITFunction, Autotuner))}


def specialise(fn, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of one launch of ``fn``, as Triton's launcher specialises
    its values (``native_specialize_impl``, the function its launcher calls)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl
    bound = inspect.signature(fn.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(fn.params):
        value = bound.arguments[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        kind, key = native_specialize_impl(BaseBackend, value, param.is_const,
                                           not param.do_not_specialize,
                                           not param.do_not_specialize_on_alignment)
        if kind == "constexpr":
            signature[param.name], constexprs[param.name] = "constexpr", key
        else:
            signature[param.name] = kind
            if key:
                attrs[(index,)] = BaseBackend.parse_attr(key)
    return signature, constexprs, attrs


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` appends its launches."""

    def __init__(self, name: str, kernel, launches: list, phase: list):
        self.name, self.kernel, self.launches, self.phase = name, kernel, launches, phase

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs):
        warps = kwargs.pop("num_warps", 4)
        stages = kwargs.pop("num_stages", 3)
        from triton.runtime.autotuner import Autotuner
        configs = self.kernel.configs if isinstance(self.kernel, Autotuner) else None
        fn = self.kernel.fn if configs is not None else self.kernel   # the JITFunction
        if configs is None:
            self._keep(fn, args, kwargs, warps, stages, "")
            return
        names = fn.arg_names
        if self.kernel.early_config_prune:   # the kernel's own pruning, as its autotuner does
            configs = self.kernel.early_config_prune(configs, dict(zip(names, args)), **kwargs)
        for config in configs:
            nargs = {**dict(zip(names, args)), **kwargs, **config.kwargs}
            if config.pre_hook:
                config.pre_hook(nargs)   # the tutorial's sets its descriptors' block shapes
            self._keep(fn, (), {n: nargs[n] for n in names if n in nargs}, config.num_warps,
                       config.num_stages, config_name(config))

    def _keep(self, fn, args, kwargs, warps, stages, config):
        signature, constexprs, attrs = specialise(fn, args, kwargs)
        self.launches.append(Launch(self.name, self.phase[0], fn, signature, constexprs, attrs,
                                    warps, stages, config))


class _Ctx:
    """The autograd context the tutorial's Function reads and writes."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


@dataclass(frozen=True)
class Capture:
    """The launches of one causal forward and backward; ``refused``: the tutorial's own refusal
    of this architecture's forward (an AssertionError's message), "" when it ran."""
    launches: tuple[Launch, ...]
    refused: str = ""


def capture(module, head_dim: int, arch: str, shape=CAPTURE_SHAPE) -> Capture:
    """Every launch of the tutorial's causal forward and backward at ``head_dim`` (fp16) on
    ``arch``. A copy that refuses the architecture's forward (a trimmed copy keeps only the
    Hopper one) still gives its backward: the forward then runs as on sm_90 to fill the saved
    tensors the backward reads, and its launches are dropped."""
    import torch
    kernels, launches, phase = _kernels(module), [], ["fwd"]
    recorders = {name: _Recorder(name, kernel, launches, phase) for name, kernel in kernels.items()}
    batch, heads, n = shape
    q, k, v, do = (torch.randn(batch, heads, n, head_dim, dtype=torch.float16) for _ in range(4))
    vars(module).update(recorders)
    ctx, refused = _Ctx(), ""
    try:
        try:
            with _as_target(arch):
                module._attention.forward(ctx, q, k, v, True, head_dim ** -0.5)
        except AssertionError as err:
            refused = str(err) or "AssertionError"
            with _as_target("sm_90"):
                module._attention.forward(ctx, q, k, v, True, head_dim ** -0.5)
            launches.clear()
        phase[0] = "bwd"
        with _as_target(arch):
            module._attention.backward(ctx, do)
    finally:
        vars(module).update(kernels)
    return Capture(tuple(launches), refused)


# ----------------------------------------------------------------------------------------
# Compile and model
# ----------------------------------------------------------------------------------------
# the tutorial's tiles: each loop's constexprs and the matmuls each score takes in it
FORWARD_LOOP = ("BLOCK_M", "BLOCK_N", 2)
BACKWARD_LOOPS = (("BLOCK_M1", "BLOCK_N1", 4),   # dK/dV: S^T, dV, dP^T, dK
                  ("BLOCK_M2", "BLOCK_N2", 3))   # dQ: S, dP, dQ


def _loop_units(k, loop: tuple, arch: str, head_dim: int, constexprs: dict) -> tuple[dict, int]:
    """Each unit's modelled cycles per 1000 scores (bamgen.aot.loop_model's) in the unmasked
    loop of one tile, and the loop's index in the kernel's MMA loops: the shortest of them whose tensor-core flops are that tile's (2 x head
    dim x its scores x the matmuls a score takes), since a masked loop walks smaller tiles or
    more instructions. Its flops may be a power of two times the tile's: warps too many for a
    small tile repeat its MMAs (64x64 over 8 warps on sm_80), work the model counts as issued."""
    from bamgen.aot import loop_model
    rows, cols, matmuls = loop
    if rows not in constexprs or cols not in constexprs:
        raise TutorialError(f"{k.name}: no {rows} / {cols} constexprs; the model reads the "
                            "tutorial's tile names")
    scores = constexprs[rows] * constexprs[cols]
    flops = 2 * head_dim * scores * matmuls
    matching = [i for i, mix in enumerate(k.loops)
                if _power_of_two(loop_model(mix, arch, k.num_warps)["mma_flops_per_tile"] / flops)]
    if not matching:
        raise TutorialError(f"{k.name} on {arch}: no loop of {constexprs[rows]}x{constexprs[cols]} "
                            f"scores ({flops} tensor-core flops a pass)")
    index = min(matching, key=lambda i: k.loops[i]["total"])
    cycles = loop_model(k.loops[index], arch, k.num_warps)["cycles"]
    return {unit: c * 1000 / scores for unit, c in cycles.items()}, index


def _power_of_two(ratio: float) -> bool:
    return ratio >= 1 and math.log2(ratio) == int(math.log2(ratio))


def _refusal(err) -> str:
    """The source line a compile error points at (Triton's message ends with it and a caret),
    and its message where it has one: what the autotuner skips such a config for."""
    lines = str(err).rstrip().splitlines()
    where = lines[-2].strip() if len(lines) >= 2 and lines[-1].strip() == "^" else type(err).__name__
    return f"{where}: {err.error_message}" if getattr(err, "error_message", None) else where


def model_launch(launch: Launch, arch: str, head_dim: int) -> Row:
    """Compile one launch and model its main loops (see the module's docstring)."""
    from triton.compiler.errors import CompilationError
    from bamgen.aot import compile_kernel
    row = Row(arch, head_dim, launch.phase, launch.kernel, launch.config or
              f"w{launch.warps} s{launch.stages}")
    try:
        k = compile_kernel(launch.kernel, launch.fn, launch.signature, launch.constexprs,
                           launch.attrs, launch.warps, launch.stages, arch)
    except CompilationError as err:
        return replace(row, note=f"does not compile: {_refusal(err)}")
    resources = dict(registers=k.registers, stack_bytes=k.stack_bytes, shared_bytes=k.shared_bytes)
    if not k.loops:
        return replace(row, **resources, note="no MMA loop (not modelled)")
    loops = (FORWARD_LOOP,) if launch.phase == "fwd" else BACKWARD_LOOPS
    modelled = [_loop_units(k, loop, arch, head_dim, launch.constexprs) for loop in loops]
    # each loop's bound unit, summed (the loops run one after the other); and per unit, for
    # the fitted model (a weighted sum of units: benchmarks/model_check.py)
    cycles = sum(max(units.values()) for units, _ in modelled)
    units = {u: round(sum(units[u] for units, _ in modelled), 1) for u in modelled[0][0]}
    return replace(row, **resources, cycles=round(cycles, 1),
                   loops=tuple(i for _, i in modelled), units=tuple(units.items()))


def tutorial_rows(path: str, arch: str, head_dim: int) -> list[Row]:
    """Every attention launch of the tutorial at (arch, head dim), compiled and modelled."""
    got = capture(load_tutorial(path, arch), head_dim, arch)
    refusal = [Row(arch, head_dim, "fwd", "-", "-", note=f"the tutorial refuses: {got.refused}")
               ] if got.refused else []
    return refusal + [model_launch(launch, arch, head_dim) for launch in got.launches
                      if "preprocess" not in launch.kernel]


@dataclass(frozen=True)
class Nope:
    """bamgen NoPE's modelled cycles per 1000 scores (fp16) in one phase: its kernels' bound
    units summed, and each unit summed over its kernels (the forward; dK/dV plus dQ)."""
    cycles: float
    units: dict


def nope_cycles(arch: str, head_dim: int) -> dict[str, Nope]:
    """(The five throughput units alone: the tutorial's rows have no latency term, whose
    scoreboard walk reads a kernel's one main loop, and its fused backward has four.)"""
    from model_check import LATENCY, modelled
    kernels = modelled("uniform", head_dim, arch, "fp16")
    kernels = {n: {u: c for u, c in units.items() if u != LATENCY} for n, units in kernels.items()}
    out = {}
    for phase, names in (("fwd", ("fwd",)), ("bwd", ("dkdv", "dq"))):
        out[phase] = Nope(sum(max(kernels[n].values()) for n in names),
                          {u: sum(kernels[n][u] for n in names) for u in kernels[names[0]]})
    return out


def model_pick(rows: list[Row], phase: str) -> tuple[Row | None, int]:
    """The config the autotuner would keep if the model were right, and how many others model
    the same cycles (ties, which the model cannot order): the fewest modelled cycles among
    those that fit and do not spill; a kernel launched with one config (the backward), that
    one even where it spills."""
    compiled = [r for r in rows if r.phase == phase and r.cycles is not None]
    usable = [r for r in compiled if r.usable] or (compiled if len(compiled) == 1 else [])
    pick = min(usable, key=lambda r: r.cycles, default=None)
    return pick, 0 if pick is None else sum(r.cycles == pick.cycles for r in usable) - 1


# ----------------------------------------------------------------------------------------
# Measured (a benchmarks/gpu.py --kernels run with the tutorial peer)
# ----------------------------------------------------------------------------------------
def run_arch(run: dict) -> str:
    """The family of the GPU a run timed, from the capability gpu.py records (runs before it
    did: sm_90, the family of the only GPUs timed then)."""
    capability = run.get("env", {}).get("capability")
    return "sm_80" if capability and capability[0] < 9 else "sm_90"


def measured_ratios(run: dict, tutorial_kernels: dict[str, set[str]]) -> dict[int, list[dict]]:
    """{head dim: [{"N": ..., "fwd": NoPE / tutorial, "bwd": ..., "configs": {kernel: config},
    "tutorial_cycles": {phase: cycles per 1000 scores}}, one per sequence length]} of a run's
    kernel times: the tutorial's captured attention kernels against bamgen NoPE's forward and
    dK/dV plus dQ, the configs its autotuners kept (runs since they are recorded), and the
    tutorial's time in the model's unit (model_check.measured_cycles)."""
    from model_check import measured_cycles
    out = {}
    for result in run["results"]:
        kernels = result.get("kernels", {})
        ours, theirs = kernels.get("bamgen-uniform", {}), kernels.get("tutorial", {})
        if not ours or not theirs:
            continue
        nope = {"fwd": ours.get("fwd:_attn_fwd", {}).get("us"),
                "bwd": sum(ours.get(f"bwd:{k}", {}).get("us", 0) for k in ("_attn_bwd_dkdv", "_attn_bwd_dq"))}
        ratios = {"N": result["N"], "configs": result.get("configs", {}).get("tutorial", {}),
                  "tutorial_cycles": {}}
        for phase in ("fwd", "bwd"):
            time = sum(theirs.get(f"{phase}:{k}", {}).get("us", 0) for k in tutorial_kernels[phase])
            if time and nope[phase]:
                ratios[phase] = nope[phase] / time
                ratios["tutorial_cycles"][phase] = measured_cycles(time, result)
        out.setdefault(result["D"], []).append(ratios)
    return out


def _measured(runs: list[dict], phase: str) -> str:
    if not runs:
        return "-"
    shown = [f"{r[phase]:.2f}x" for r in runs if phase in r]
    if len(runs) > 1:
        shown = [f"{r[phase]:.2f}x at N={r['N']}" for r in runs if phase in r]
    return ", ".join(shown) or "-"


def report(rows: list[Row], nope: dict, measured: dict, fit: tuple[str, dict] | None = None) -> list[str]:
    lines = ["| arch | D | kernel | config | registers | stack | shared KB | cycles / 1000 scores | note |",
             "|---|---:|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        cycles = "-" if r.cycles is None else f"{r.cycles:.0f}"
        note = r.note or ("" if r.usable else "over shared memory" if r.shared_bytes > SHARED_LIMIT[r.arch]
                          else "spills")
        lines.append(f"| {r.arch} | {r.head_dim} | {r.kernel} | {r.config} | {r.registers} | "
                     f"{r.stack_bytes} | {r.shared_bytes / 1024:.0f} | {cycles} | {note} |")
    lines += ["", "| arch | D | phase | tutorial (model's pick) | cycles | bamgen NoPE cycles | "
              "NoPE / tutorial, modelled | measured | autotuner's pick |",
              "|---|---:|---|---|---:|---:|---:|---:|---|"]
    for (arch, head_dim), ours in sorted(nope.items()):
        for phase in ("fwd", "bwd"):
            cycles = ours[phase].cycles
            here = [r for r in rows if (r.arch, r.head_dim) == (arch, head_dim)]
            pick, ties = model_pick(here, phase)
            runs = measured.get(arch, {}).get(head_dim, [])
            kept = sorted({r["configs"][row.kernel] for r in runs for row in here
                           if row.phase == phase and row.kernel in r["configs"]})
            refused = [r.note for r in here if r.phase == phase and r.note.startswith("the tutorial refuses")]
            name = ("none usable" if pick is None and not refused else "refused by this copy"
                    if pick is None else pick.config + ("" if pick.usable else " (spills)")
                    + (f" (tied with {ties})" if ties else ""))
            lines.append(f"| {arch} | {head_dim} | {phase} | {name} | "
                         f"{f'{pick.cycles:.0f}' if pick else '-'} | {cycles:.0f} | "
                         f"{f'{cycles / pick.cycles:.2f}x' if pick else '-'} | "
                         f"{_measured(runs, phase)} | {', '.join(kept) or '-'} |")
    return lines + (_fitted_table(rows, nope, measured, fit) if fit else [])


def _fitted_table(rows: list[Row], nope: dict, measured: dict, fit: tuple[str, dict]) -> list[str]:
    """The fitted model (weights fitted to another run's bamgen kernels, of one family) on the
    model's picks of that family: an out-of-sample test of the fit, where a run measured the
    tutorial."""
    fit_arch, weights = fit
    lines = ["", f"The fitted model ({fit_arch}): " + ", ".join(f"{u} {w:.2f}" for u, w in weights.items()),
             "", "| arch | D | phase | tutorial, fitted | tutorial, measured | error | "
             "NoPE / tutorial, fitted | measured |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for (arch, head_dim), ours in sorted(nope.items()):
        if arch != fit_arch:
            continue
        for phase in ("fwd", "bwd"):
            pick, _ = model_pick([r for r in rows if (r.arch, r.head_dim) == (arch, head_dim)], phase)
            if pick is None:
                continue
            theirs = weighted(pick.units, weights)
            runs = measured.get(arch, {}).get(head_dim, [])
            got = [r["tutorial_cycles"][phase] for r in runs if phase in r["tutorial_cycles"]]
            error = ", ".join(f"{theirs / g - 1:+.0%}" for g in got) or "-"
            lines.append(f"| {arch} | {head_dim} | {phase} | {theirs:.0f} | "
                         f"{', '.join(f'{g:.0f}' for g in got) or '-'} | {error} | "
                         f"{weighted(ours[phase].units, weights) / theirs:.2f}x | "
                         f"{_measured(runs, phase)} |")
    return lines


def _read_run(path: str) -> dict:
    """A benchmarks/gpu.py JSON, checked for the fields this report reads (ValueError if not)."""
    run = json.loads(Path(path).read_text())
    results = run.get("results") if isinstance(run, dict) else None
    if not isinstance(results, list) or not results or not all(
            isinstance(r, dict) and {"N", "B", "H", "D"} <= r.keys() for r in results):
        raise ValueError("no results with N, B, H and D")
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tutorial", metavar="PATH", help="a copy of Triton's python/tutorials/06-fused-attention.py")
    ap.add_argument("--arch", nargs="+", default=["sm_90", "sm_80"], choices=sorted(ARCHS))
    ap.add_argument("--head-dim", nargs="+", type=int, default=[64, 128], choices=[64, 128])
    ap.add_argument("--run", metavar="JSON", help="a benchmarks/gpu.py --kernels run with the "
                                                  "tutorial peer: its measured ratios, beside its GPU's family")
    ap.add_argument("--pairs", metavar="JSON", nargs="+",
                    help="benchmarks/model_check.py --pairs files: the fitted model, its weights "
                         "fitted to their points together")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    if not Path(args.tutorial).is_file():
        ap.error(f"tutorial: no file {args.tutorial}")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        ap.error(f"--json: no folder {Path(args.json).parent} to write {Path(args.json).name} in")
    run = None
    if args.run:
        try:
            run = _read_run(args.run)
        except (OSError, ValueError) as err:
            ap.error(f"--run: {args.run} is not a benchmarks/gpu.py JSON ({err})")
    fit = None
    if args.pairs:
        from model_check import UNITS, fit_units, read_pairs
        try:
            points = read_pairs(args.pairs)
        except ValueError as err:
            ap.error(f"--pairs: {err}")
        if len(points) <= len(UNITS):
            ap.error(f"--pairs: {len(points)} points fit no {len(UNITS)} weights")
        families = {p.arch for p in points}
        if len(families) > 1:
            ap.error(f"--pairs: points of {' and '.join(sorted(families))}; a fit holds for one family")
        fit = (families.pop(), fit_units(points))
    rows, nope = [], {}
    try:
        for arch in args.arch:
            for head_dim in args.head_dim:
                rows += tutorial_rows(args.tutorial, arch, head_dim)
                nope[(arch, head_dim)] = nope_cycles(arch, head_dim)
    except TutorialError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    kernels = {phase: {r.kernel for r in rows if r.phase == phase} for phase in ("fwd", "bwd")}
    measured = {run_arch(run): measured_ratios(run, kernels)} if run else {}
    print("\n".join(report(rows, nope, measured, fit)))
    if args.json:
        Path(args.json).write_text(json.dumps([{**asdict(r), "usable": r.usable} for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
