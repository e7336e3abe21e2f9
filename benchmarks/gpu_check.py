"""`make gpu-check`: what a machine with a CUDA GPU should confirm, in one command, within 10 minutes.

    python benchmarks/gpu_check.py                        # what `make gpu-check` runs
    python benchmarks/gpu_check.py --bench-args "--n 1024 4096 --head-dim 64 128"
    python benchmarks/gpu_check.py --archive /tmp/gpu-check.tgz   # the run's files in one archive

With a CUDA GPU that torch can use, it runs six steps, one after the other, each under a time
limit (LIMITS_S: each has its own but the benchmark, which gets what the others leave of
TOTAL_S, 9.5 minutes in all; a step killed at its limit counts as failed, and the tests a
step has seen fail by then are named, BAMGEN_FAILURES_AT_ONCE in tests/conftest.py):

1. ``properties``: the Triton backend's property tests and hard cases, and the module tests, with
   CUDA tensors against the float64 reference on the CPU (``BAMGEN_TEST_DEVICE=cuda`` switches
   tests/runtime/test_properties.py to the GPU; same cases, seeds and tolerances as under the
   interpreter), and every shipped prior's Triton check of tests/runtime/test_library.py (BAM-SSMax
   included, which the property tests do not draw);
2. ``aot``: tests/gpu/test_aot.py for this GPU's family only (``-k sm_90`` on Hopper and newer,
   ``-k sm_80`` on Ampere and Ada, the keys of the tile tables), the compiles `make test` runs
   (``-m "not aot_full"``: on sm_90 every shipped prior at head dim 128, the register-bound
   case, and the positional and table-at-positions representatives; the whole family's matrix,
   119 compiles on sm_90, would take minutes even on 15 workers): they compile with no register
   spills by the machine's own Triton;
3. ``compile``: the Triton path under torch.compile (tests/runtime/test_compile.py -k triton, with
   ``BAMGEN_TEST_DEVICE=cuda`` and ``TRITON_DEFAULT_FP_FUSION=0``, which the triton ops need): inductor compiles the triton ops' kernel launches, fullgraph and
   dynamic, a training step over three lengths and decode steps over a growing cache, equal to
   eager with no recompile;
4. ``variants``: benchmarks/gpu.py on kernel variants that the model cannot rank or that a
   GPU should confirm, each timed against the shipped kernel in the same run (VARIANT_ARGS: pinned tiles and the
   forward's table gather, ``bamgen-<prior>@<pins>``, and a build with the other lowering
   strategy, ``bamgen-ssmax-inline``, which the model step leaves out; forwards alone, but
   the backwards of the dK/dV kernel's two variants, VARIANT_BACKWARD_PEERS;
   N = 8192 at head dims 64 and 128, the shape of the points already fitted; and the decode
   kernel's table read, its K and V through TMA and its step with the distance table built by
   torch instead of the table kernels, 64 sequences against 4096 cached keys), its table to
   <device>-<date>-variants.md and its JSON beside it;
5. ``benchmark``: benchmarks/gpu.py on a bounded set of sizes (BENCH_ARGS), which writes its
   report, one markdown table of times and ratios, to docs/results/gpu/<device>-<date>.md (and
   the raw results beside it as .json, each kernel's device time included: --kernels);
6. ``model``: benchmarks/model_check.py on both JSONs: the throughput model's prediction beside
   each kernel's measured time, with leave-one-out errors, appended to the report, fitted
   together with the points of every earlier run kept beside it (``*pairs.json``); this run's
   pairs go to <device>-<date>-pairs.json for the next fit (docs/performance.md, "Second GPU
   session").
This script then adds the outcome of the six steps to the report and prints where it is.

It exits 0 when every step passed and 1 otherwise. Without a GPU (no CUDA device visible to
torch, and none that ``nvidia-smi`` lists) it prints one line saying so and what it would run,
and exits 0, so that ``make gpu-check`` can be part of any routine. A GPU that nvidia-smi sees
but torch cannot use (a CPU build of torch, say) is a broken set-up: one line, exit 1.

Only the standard library is imported before the GPU is found, so any Python runs it.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "gpu"
# the sizes the report covers: the shape (bf16, head dim 128, causal) at a short and a
# long sequence, every peer. Most of its time is FlexAttention's compiles (per peer and size) and
# its backward with learnable parameters (5 s a call at 16k on an H100). The decode steps: one
# and 64 sequences against 4096 cached keys, the shapes docs/performance.md models ("Decode
# kernel (GPU, modelled)"); one flex compile each. --kernels keeps each kernel's device time in the
# JSON: the points the GPU cost model is fit to.
BENCH_ARGS = "--n 4096 16384 --head-dim 128 --repeats 5 --decode-n 4096 --decode-batch 1 64 --kernels"
# The variants (docs/performance.md, "Third GPU session" to "Fifth GPU session"), forwards
# alone, each against the shipped kernel in the same run. An H200 and an H100 chose three
# stages for the light and table forwards on sm_90 and the direct table read over the async
# one; the H200 then chose the read one tile ahead ("prefetch", which the latency term had
# picked without a GPU: tiles.py) over both, BAM-SSMax's forward at head dim 128 the most
# (462 kernel cycles / 1k scores against 705 direct and 1794 async), and pointers over TMA for
# K and V (tiles.KV_TMA_SHIPPED: NoPE's forward at 64 through TMA over 4 warps, 1.07x the
# 8-warp pointer kernel; GGD's decode call 1.03-1.07x). Each is still timed against what ships,
# so that a GPU with another Triton can overturn it: the direct and async reads, the inline
# build, the other stage counts, and K and V through TMA (the forward with FWD_TMA_AT's tile
# at head dim 64, the tile table's at 128).
# A pin that equals the shipped config at one head dim times the shipped kernel twice there.
# The dK/dV kernel at head dim 64 on sm_90 skips its mask on steady tiles with one stage
# (tiles.DKDV_STEADY_AT; the H200: 0.81x the unsplit two-stage kernel it replaced, GGD 0.83x),
# timed against that kernel (docs/performance.md, "The dK/dV kernel's steady tiles"): both
# pinned, so that both backwards run on the calling thread (gpu.py's Peer.backward_of), their
# backwards timed (VARIANT_BACKWARD_PEERS); at head dim 128 the same two kernels, neither of
# them shipped there.
DKDV_NOW, DKDV_BEFORE = "dkdv_split=on,bwd_dkdv=32x64x4x1", "dkdv_split=off,bwd_dkdv=32x64x4x2"
VARIANT_BACKWARD_PEERS = tuple(f"bamgen-{prior}@{pins}" for prior in ("uniform", "ggd")
                               for pins in (DKDV_NOW, DKDV_BEFORE))
VARIANT_PEERS = ("bamgen-uniform", "bamgen-uniform@kv=tma", "bamgen-ggd",
                 "bamgen-ggd@fwd=128x64x8x2",
                 "bamgen-ggd@gather=direct", "bamgen-ssmax", "bamgen-ssmax@gather=direct",
                 "bamgen-ssmax@gather=async", "bamgen-ssmax-inline", *VARIANT_BACKWARD_PEERS)
# and the decode kernel's table read (at head dim 128 its 16x128 tile has Q's shape), its K and
# V through TMA (tiles.DECODE_TMA_AT) against pointers, and the step with its distance table
# built by torch on the host's orders (about forty launches) against the table kernels' two:
# 64 sequences against 4096 cached keys
VARIANT_DECODE_PEERS = ("bamgen-ggd", "bamgen-ggd@gather=coalesced", "bamgen-ggd@kv=tma",
                        "bamgen-ggd@table=host")
VARIANT_ARGS = ("--n 8192 --head-dim 64 128 --repeats 5 --warmup 1 --forward-only --kernels "
                "--decode-n 4096 --decode-batch 64 --peers " + " ".join(VARIANT_PEERS)
                + " --decode-peers " + " ".join(VARIANT_DECODE_PEERS)
                + " --backward-peers " + " ".join(VARIANT_BACKWARD_PEERS))
PROPERTY_SELECTION = "triton or hard_case or module_init"
# the property tests took 110 s on 15 workers on an H200 (docs/performance.md); the compile
# tests take ~60 s on 2 CPU workers under the interpreter, most of it tracing
TOTAL_S = 570
# (compile took 36-38 s on an H100 and an H200; variants 35 s before the dK/dV backwards joined)
LIMITS_S = {"properties": 150, "aot": 60, "compile": 60, "variants": 120, "model": 60}


STEP_NAMES = ("properties", "aot", "compile", "variants", "benchmark")


def _limit(text: str) -> tuple[str, int]:
    """--limit STEP=SECONDS, as (step, seconds)."""
    step, _, seconds = text.partition("=")
    if step not in (*LIMITS_S, "total") or not seconds.isdigit() or int(seconds) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write STEP=SECONDS with STEP one of {', '.join((*LIMITS_S, 'total'))}")
    return step, int(seconds)


@dataclass(frozen=True)
class Step:
    """One command of the check: its name, argv, extra environment and time limit."""
    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    limit_s: int

    def shell(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env)
        return (env + " " if env else "") + shlex.join(self.argv)


@dataclass(frozen=True)
class Outcome:
    step: Step
    returncode: int | None  # None: killed at its time limit
    seconds: float
    summary: str             # the step's last non-empty output line
    failures: tuple[str, ...] = ()   # the tests it named as failed (FAILED <id>), in order
    causes: tuple[tuple[str, str], ...] = ()   # (test id, the end of its error), as printed

    @property
    def passed(self) -> bool:
        return self.returncode == 0

    def line(self) -> str:
        status = ("passed" if self.passed else f"timed out after {self.step.limit_s} s"
                  if self.returncode is None else f"failed (exit {self.returncode})")
        named = f"; failed: {', '.join(self.failures)}" if self.failures and not self.passed else ""
        return f"{self.step.name}: {status} in {self.seconds:.0f} s — {self.summary}{named}"


def family(capability: tuple[int, int]) -> str:
    """The tile-table key of a compute capability, as the generated modules choose it."""
    return "sm_90" if capability[0] >= 9 else "sm_80"


def report_path(device_name: str, day: datetime.date, folder: Path) -> Path:
    """docs/results/gpu/<device>-<date>.md, e.g. nvidia-h100-80gb-hbm3-2026-11-22.md"""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "gpu"
    return folder / f"{slug}-{day.isoformat()}.md"


def plan(arch: str, python: str, report: Path, bench_args: str = BENCH_ARGS,
         workers: int = 0) -> tuple[Step, ...]:
    """The six steps for a GPU of family ``arch``; ``workers`` > 0 runs pytest under xdist."""
    pytest = (python, "-m", "pytest", "-q", "-p", "no:cacheprovider") + (
        ("-n", str(workers)) if workers else ())
    at_once = (("BAMGEN_FAILURES_AT_ONCE", "1"),)   # failures named before a kill (tests/conftest.py)
    bench = (python, "benchmarks/gpu.py", *shlex.split(bench_args),
             "--markdown", str(report), "--json", str(report.with_suffix(".json")))
    variants = (python, "benchmarks/gpu.py", *shlex.split(VARIANT_ARGS),
                "--markdown", str(variants_json(report).with_suffix(".md")),
                "--json", str(variants_json(report)))
    return (
        Step("properties", pytest + ("tests/runtime/test_properties.py", "tests/runtime/test_library.py", "-k",
                                     PROPERTY_SELECTION),
             (("BAMGEN_TEST_DEVICE", "cuda"), ("TRITON_INTERPRET", "0")) + at_once,
             LIMITS_S["properties"]),
        Step("aot", pytest + ("tests/gpu/test_aot.py", "-k", arch, "-m", "not aot_full"), at_once,
             LIMITS_S["aot"]),
        Step("compile", pytest + ("tests/runtime/test_compile.py", "-k", "triton"),
             (("BAMGEN_TEST_DEVICE", "cuda"), ("TRITON_INTERPRET", "0"),
              ("TRITON_DEFAULT_FP_FUSION", "0")) + at_once, LIMITS_S["compile"]),
        Step("variants", variants, (), LIMITS_S["variants"]),
        Step("benchmark", bench, (), TOTAL_S - sum(LIMITS_S.values())),
        model_step(python, arch, report, (report.with_suffix(".json"), variants_json(report))),
    )


def variants_json(report: Path) -> Path:
    return report.with_name(report.stem + "-variants.json")


def pairs_json(report: Path) -> Path:
    return report.with_name(report.stem + "-pairs.json")


def model_step(python: str, arch: str, report: Path, runs) -> Step:
    """benchmarks/model_check.py on the runs' JSONs (main keeps those that were written), fitted
    with every earlier run's points kept beside the report (its --with-pairs): each GPU run
    adds to the fit instead of replacing it."""
    earlier = sorted(p for p in report.parent.glob("*pairs.json") if p != pairs_json(report))
    return Step("model", (python, "benchmarks/model_check.py", *map(str, runs), "--arch", arch,
                          "--append", str(report),
                          "--pairs", str(pairs_json(report)),
                          *(arg for p in earlier for arg in ("--with-pairs", str(p)))),
                (), LIMITS_S["model"])


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]


def find_gpu() -> tuple[Gpu | None, str]:
    """(the first CUDA device torch can use, or None; why there is none)."""
    try:
        import torch
    except ImportError as err:
        why = f"torch is not importable by {sys.executable} ({err})"
    else:
        if torch.cuda.is_available():
            return Gpu(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0)), ""
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        why = f"torch {torch.__version__} ({build}) sees no CUDA device"
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        why += f", CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}"
    return None, why


def nvidia_smi_gpus() -> list[str]:
    """The GPUs `nvidia-smi -L` lists (empty without the tool or a driver)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        res = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line for line in res.stdout.splitlines() if line.startswith("GPU ")]


def run_step(step: Step) -> Outcome:
    """Run one step from the repository root, its output passed through as it comes; on its time
    limit the whole process group (pytest-xdist workers included) is killed."""
    print(f"\n== gpu-check {step.name} (limit {step.limit_s} s): {step.shell()}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(step.argv, cwd=ROOT, env={**os.environ, **dict(step.env)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    last, failures, tails = [""], [], FailureTails()

    def pump():
        for line in proc.stdout:
            sys.stdout.write(line)
            if line.strip():
                last[0] = line.strip()
            failed = failed_test(line)
            if failed and failed not in failures:
                failures.append(failed)
            tails.feed(line)
        sys.stdout.flush()
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        returncode = proc.wait(timeout=step.limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        returncode = None
    reader.join(timeout=10)
    return Outcome(step, returncode, time.monotonic() - t0, last[0].strip("= ")[:200],
                   tuple(failures), tuple(tails.causes))


def failed_test(line: str) -> str | None:
    """The test id of a line ``FAILED <id> (<phase>)`` (the conftest's failure at once) or
    ``FAILED|ERROR <id> - <message>`` (pytest's summary), else None."""
    found = FAILED_LINE.match(line.rstrip("\n"))
    return found.group(1) if found else None


FAILED_LINE = re.compile(r"^(?:FAILED|ERROR) (.+?)(?: \((?:setup|call|teardown)\)| - .*)?$")
AT_ONCE_LINE = re.compile(r"^FAILED (.+?) \((?:setup|call|teardown)\)$")
FAILURE_END = "END FAILED "   # tests/conftest.py closes each failure's tail with it


class FailureTails:
    """The end of each failed test's error, from the blocks tests/conftest.py prints as a test
    fails (`FAILED <id> (<phase>)`, its error's last lines, `END FAILED <id>`): the report keeps
    them, so a GPU run that fails says why without another command on the GPU (the compile
    step of an H200 named three failures and kept no cause)."""

    def __init__(self):
        self.causes: list[tuple[str, str]] = []
        self._open: tuple[str, list[str]] | None = None

    def feed(self, line: str) -> None:
        line = line.rstrip("\n")
        if self._open is not None:
            test, lines = self._open
            if line == FAILURE_END + test:
                self.causes.append((test, "\n".join(lines)))
                self._open = None
            else:
                lines.append(line)
            return
        found = AT_ONCE_LINE.match(line)
        if found:
            self._open = (found.group(1), [])


CAUSES_KEPT = 5   # failures per step whose error the report quotes


def finish_report(report: Path, outcomes: list[Outcome]) -> None:
    """Append the outcome of every step to the benchmark's report, with the end of the error of
    each step's first CAUSES_KEPT failures."""
    lines = ["", "## The checks of this run (`make gpu-check`)", ""]
    for o in outcomes:
        lines.append(f"* {o.line()}")
        lines.append(f"  `{o.step.shell()}`")
        for test, tail in o.causes[:CAUSES_KEPT]:
            lines += ["", f"  {test}:", "", "  ```", *(f"  {t}" for t in tail.splitlines()), "  ```"]
    with report.open("a") as f:
        f.write("\n".join(lines) + "\n")


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _xdist_workers() -> int:
    try:
        import xdist  # noqa: F401
    except ImportError:
        return 0
    return max(1, min(15, (os.cpu_count() or 2) - 1))


def main(argv=None, run=run_step, today=datetime.date.today, clock=time.monotonic) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench-args", default=BENCH_ARGS,
                        help=f'arguments for benchmarks/gpu.py (default: "{BENCH_ARGS}")')
    parser.add_argument("--skip", nargs="+", default=[], choices=STEP_NAMES, metavar="STEP",
                        help=f"steps not to run, of: {' '.join(STEP_NAMES)} (a short lease)")
    parser.add_argument("--limit", action="append", default=[], type=_limit, metavar="STEP=S",
                        help="another time limit for a step, in seconds (total=S: the whole "
                             f"check, default {TOTAL_S}; the benchmark gets what is left)")
    parser.add_argument("--archive", type=Path, metavar="FILE.tar.gz",
                        help="also put this run's files (the report, the JSONs, the pairs) into "
                             "one gzipped tar, for a rented machine that sends back few files")
    args = parser.parse_args(argv)
    if args.archive is not None:
        why_not = archive_problem(args.archive)
        if why_not:
            parser.error(f"--archive {args.archive}: {why_not}")
    limits = {**LIMITS_S, "total": TOTAL_S, **dict(args.limit)}
    gpu, why = find_gpu()
    if gpu is None:
        seen = nvidia_smi_gpus()
        if seen:
            print(f"gpu-check: nvidia-smi lists {seen[0]}, but {why}: run it with a Python whose "
                  "torch is a CUDA build (make gpu-check PYTHON=...)")
            return 1
        unarchived = f"; nothing archived in {args.archive}" if args.archive is not None else ""
        print(f"gpu-check: no GPU here ({why}; nvidia-smi lists none), nothing run; with CUDA it "
              f"runs tests/runtime/test_properties.py tests/runtime/test_library.py -k \"{PROPERTY_SELECTION}\" "
              f"on CUDA tensors, "
              f"tests/gpu/test_aot.py -k <the GPU's sm_80|sm_90> -m \"not aot_full\", tests/runtime/test_compile.py -k triton on "
              f"CUDA tensors, benchmarks/gpu.py on forward kernel variants and with "
              f"{args.bench_args}, benchmarks/model_check.py on both, and writes "
              f"docs/results/gpu/<device>-<date>.md{unarchived}")
        return 0
    arch = family(gpu.capability)
    report = report_path(gpu.name, today(), RESULTS)
    report.parent.mkdir(parents=True, exist_ok=True)
    # a second run on the same day replaces the first, whose JSONs the model step must not read
    for path in (report, report.with_suffix(".json"), variants_json(report),
                 variants_json(report).with_suffix(".md"), pairs_json(report)):
        path.unlink(missing_ok=True)
    print(f"gpu-check on {gpu.name} ({arch}); report: {_shown(report)}", flush=True)
    outcomes, t0 = [], clock()
    for step in plan(arch, sys.executable, report, args.bench_args, _xdist_workers()):
        if step.name in args.skip:
            print(f"gpu-check: {step.name} skipped (--skip)", flush=True)
            continue
        if step.name == "benchmark":   # what the others leave of the total
            after = limits["model"] if "model" not in args.skip else 0
            step = replace(step, limit_s=int(limits["total"] - after - (clock() - t0)))
        elif step.name == "model":   # the runs that wrote their JSON (a step may have failed)
            runs = [report.with_suffix(".json"), variants_json(report)]
            step = replace(model_step(sys.executable, arch, report,
                                      [r for r in runs if r.exists()] or runs[:1]),
                           limit_s=limits["model"])
        else:
            step = replace(step, limit_s=limits[step.name])
        outcomes.append(run(step))
    print()
    for o in outcomes:
        print(f"gpu-check {o.line()}")
    if report.exists():
        finish_report(report, outcomes)
        print(f"gpu-check: benchmark table written to {_shown(report)}")
    else:
        print("gpu-check: the benchmark wrote no report (see its output above)")
    if args.archive is not None:
        kept = write_archive(args.archive, run_files(report))
        print(f"gpu-check: {len(kept)} file(s) of this run archived in {args.archive}")
    return 0 if all(o.passed for o in outcomes) else 1


def run_files(report: Path) -> list[Path]:
    """The files a run wrote beside its report, those that exist, report first."""
    paths = (report, report.with_suffix(".json"), variants_json(report).with_suffix(".md"),
             variants_json(report), pairs_json(report))
    return [p for p in paths if p.exists()]


def archive_problem(path: Path) -> str | None:
    """Why --archive cannot be written there (checked before any step runs), else None."""
    if not path.name.endswith((".tar.gz", ".tgz")):
        return "name it .tar.gz or .tgz (it is a gzipped tar)"
    if path.parent.exists() and not path.parent.is_dir():
        return f"{path.parent} is not a folder"
    if not path.parent.is_dir():
        return f"its folder {path.parent} does not exist"
    if path.is_dir():
        return "that is a folder; give a file name"
    if not os.access(path.parent, os.W_OK):
        return f"its folder {path.parent} is not writable"
    return None


def write_archive(path: Path, files: list[Path]) -> list[Path]:
    """files, named as from the repository root (docs/results/gpu/...), into a gzipped tar at
    path, written whole (a temporary file renamed over it)."""
    import tarfile
    partial = path.with_name(path.name + ".partial")
    try:
        with tarfile.open(partial, "w:gz") as tar:
            for f in files:
                tar.add(f, arcname=_shown(f))
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return files


if __name__ == "__main__":
    sys.exit(main())
