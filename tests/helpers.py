"""Small helpers shared by the compiler tests."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_prior(folder: Path, text: str, name: str = "prior.yaml") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m bamgen.cli ARGS`` in a fresh interpreter, as a user's shell would."""
    return subprocess.run([sys.executable, "-m", "bamgen.cli", *args], cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=300, env=env)


def run_cli_in_process(*args: str, cwd: Path | None = None):
    """The CLI in this process (click's runner; its result has exit_code, stdout and stderr),
    with ``cwd`` as the working folder: for a corpus of refusals, where a fresh interpreter per
    file would cost seconds each and test nothing more than run_cli's few cases do."""
    import os

    from click.testing import CliRunner

    from bamgen.cli import main
    here = os.getcwd()
    os.chdir(cwd or ROOT)
    try:
        return CliRunner().invoke(main, list(args))
    finally:
        os.chdir(here)


def load_script(path: Path, name: str):
    """Import a script that is not in a package (benchmarks/*.py) as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# The AOT compiles run in a process that imports Triton without the interpreter (this one
# runs under it: conftest.py). A process per `bamgen inspect` call paid 3.5 s of imports for
# each of the suite's ~35 calls; one process per test worker, fed one call at a time, pays it
# once. Each reply is one line after the marker, so that whatever else writes to the process's
# stdout (a compiler's own output) cannot be mistaken for it.
_AOT_MARK = "@@bamgen-aot-reply@@ "
_AOT_SERVER = r"""
import contextlib, io, json, sys, traceback
from click.testing import CliRunner
from bamgen.cli import main


def cli(args):
    result = CliRunner().invoke(main, args)
    err = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        err = "".join(traceback.format_exception(result.exception))
    return result.exit_code, result.stdout, err


def script(code, argv):
    out, err, rc = io.StringIO(), io.StringIO(), 0
    sys.argv = ["-c", *argv]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            exec(compile(code, "<script>", "exec"), {"__name__": "__main__"})
        except SystemExit as exit:
            rc = exit.code if isinstance(exit.code, int) else 1
        except BaseException:
            traceback.print_exc()
            rc = 1
    return rc, out.getvalue(), err.getvalue()


for line in sys.stdin:
    request = json.loads(line)
    rc, out, err = cli(request["cli"]) if "cli" in request else script(request["script"], request["argv"])
    sys.stdout.write(MARK + json.dumps({"rc": rc, "stdout": out, "stderr": err}) + "\n")
    sys.stdout.flush()
"""
_aot_process = None


def run_cli_aot(*args: str) -> subprocess.CompletedProcess:
    """``bamgen ARGS`` (an `inspect`) in this worker's compiling process: as run_cli, without
    the interpreter, and without a fresh interpreter per call."""
    return _ask_aot({"cli": list(args)}, args)


def run_script_aot(code: str, *argv: str) -> subprocess.CompletedProcess:
    """``python -c CODE ARGV`` in this worker's compiling process (a script that compiles
    kernels ahead of time and prints its findings), from the repository's root."""
    return _ask_aot({"script": code, "argv": list(argv)}, argv)


def _ask_aot(request: dict, args) -> subprocess.CompletedProcess:
    import atexit
    import json
    import os
    global _aot_process
    if _aot_process is None or _aot_process.poll() is not None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        _aot_process = subprocess.Popen(
            [sys.executable, "-c", f"MARK = {_AOT_MARK!r}\n" + _AOT_SERVER], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        atexit.register(_aot_process.kill)
    _aot_process.stdin.write(json.dumps(request) + "\n")
    _aot_process.stdin.flush()
    for line in _aot_process.stdout:
        if line.startswith(_AOT_MARK):
            reply = json.loads(line[len(_AOT_MARK):])
            return subprocess.CompletedProcess(args, reply["rc"], reply["stdout"], reply["stderr"])
    raise RuntimeError("the AOT process exited without replying (its stderr is this test's)")


def gqa_call_grads(module, g, batch: int, nq: int, nk: int, **kw) -> list:
    """One Triton-path call of a generated module on random GQA inputs (2 query heads over 1
    KV head, head dim 16) with its default parameters: the output and every gradient (q, k, v,
    the learnable parameters) for a random incoming gradient, all drawn from generator g (a
    prior whose initial values are random, T5's buckets, draws them from g's seed)."""
    import torch
    q = torch.randn(batch, 2, nq, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(batch, 1, nk, 16, generator=g, requires_grad=True) for _ in range(2))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(g.initial_seed())
        params = {name: t.clone().requires_grad_() for name, t in module.default_params(2).items()}
    out = module.attention(q, k, v, backend="triton", **kw, **params)
    grads = torch.autograd.grad(out, [q, k, v, *params.values()],
                                torch.randn(out.shape, generator=g), allow_unused=True)
    return [out.detach(), *(t for t in grads if t is not None)]
