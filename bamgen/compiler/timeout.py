"""Time bounds on a build, so a hostile formula cannot keep SymPy busy for ever.

Two kinds of bound:

* :func:`time_limit`: wall-clock seconds (the CLI's last resort, ``BuildTimeout``);
* :func:`cpu_budget`: CPU seconds of this process for one compiler stage, a last guard far
  above any accepted file's needs: the stages bound their work by counting it (sizes, nodes,
  limits, operations), since even CPU time varies with a machine's load (caches, frequency).
  Expiry raises a :class:`~bamgen.errors.SpecError` naming the field being compiled (see
  :func:`working_on`).

Both use interval timers and signals, which Python delivers to the main thread only; elsewhere
(a build started from a worker thread) they are no-ops and the size bounds of the stages
(formula.py, symbolic.py) are the only bound. Timers nest: an inner bound never extends an
outer one, and the outer one is re-armed with what is left of it when the inner one ends.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager

from ..errors import SpecError

# CPU seconds one stage (the symbolic analysis, or the lowering and printing) may take: a last
# guard, far above what any accepted file needs. What bounds a build is its work, counted by
# the stages themselves (formula sizes, derivative nodes, symbolic limits, the scan's
# operations: docs/reliability.md), so that a file builds or is refused the same way on an
# idle laptop and a loaded CI runner. The shipped priors need a few seconds at most (FIRE,
# 99 learnable scalars); BAMGEN_BUILD_CPU_SECONDS overrides it.
STAGE_CPU_SECONDS = 60.0
CPU_SECONDS_ENV = "BAMGEN_BUILD_CPU_SECONDS"

_fields: list[tuple[str, str]] = []    # (field, what), innermost last: see working_on


class BuildTimeout(BaseException):
    """The build ran past its time limit; ``where`` is the innermost (field, what) of
    :func:`working_on` open when it expired. A BaseException, like KeyboardInterrupt: SymPy
    catches Exception in places, and must not swallow it."""

    def __init__(self, message: str, where: tuple[str, str] | None = None):
        super().__init__(message)
        self.where = where


def stage_cpu_seconds() -> float:
    """The CPU budget of one stage: STAGE_CPU_SECONDS unless BAMGEN_BUILD_CPU_SECONDS is set;
    a setting that is no number of seconds > 0 is refused, naming it, as BAMGEN_LOCK_TIMEOUT
    is (it was ignored: the user believed the budget changed)."""
    raw = os.environ.get(CPU_SECONDS_ENV, "").strip()
    if not raw:
        return STAGE_CPU_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise SpecError(f"{CPU_SECONDS_ENV}={raw!r}: give a finite number of seconds > 0",
                        hint=f"unset it for the default {STAGE_CPU_SECONDS:g} s")
    return value


def _usable() -> bool:
    return threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")


@contextmanager
def _timer(which: int, signum: int, seconds: float, message: str):
    """Raise BuildTimeout(message) in this block after ``seconds`` of the given timer."""
    if not _usable():
        yield
        return
    outer_left, _ = signal.getitimer(which)
    start = time.monotonic() if which == signal.ITIMER_REAL else time.process_time()
    if outer_left and outer_left < seconds:   # never extend an enclosing bound
        seconds = outer_left

    def expire(signum, frame):
        raise BuildTimeout(message, _fields[-1] if _fields else None)

    previous = signal.signal(signum, expire)
    signal.setitimer(which, seconds)
    try:
        yield
    finally:
        signal.setitimer(which, 0)
        signal.signal(signum, previous)
        if outer_left:
            spent = (time.monotonic() if which == signal.ITIMER_REAL else time.process_time()) - start
            # re-arm the enclosing timer with what is left (at least a moment, so it still fires)
            signal.setitimer(which, max(outer_left - spent, 1e-3))


@contextmanager
def time_limit(seconds: float):
    """Raise BuildTimeout in this block after ``seconds`` of wall-clock time."""
    with _timer(signal.ITIMER_REAL, signal.SIGALRM, seconds, f"build exceeded {seconds} s"):
        yield


@contextmanager
def working_on(field: str, what: str):
    """Name what the enclosed code compiles, for the message of an expired CPU budget."""
    _fields.append((field, what))
    try:
        yield
    finally:
        _fields.pop()


@contextmanager
def cpu_budget(field: str, what: str, seconds: float | None = None):
    """Refuse with a SpecError when the enclosed stage takes more than ``seconds`` of CPU time
    (default :func:`stage_cpu_seconds`). The error names the innermost field of
    :func:`working_on`, or ``field`` when none is open."""
    seconds = stage_cpu_seconds() if seconds is None else seconds
    try:
        with working_on(field, what):
            with _timer(signal.ITIMER_PROF, signal.SIGPROF, seconds, "cpu"):
                yield
    except BuildTimeout as exc:
        if str(exc) != "cpu":
            raise       # the wall-clock limit of an enclosing time_limit: not ours
        where, doing = exc.where or (field, what)
        raise SpecError(f"{doing} took more than {seconds:g} s of CPU time", field=where,
                        hint="simplify the formula: fewer nested functions, Abs kinks or "
                             f"Min/Max arguments; or give the build more with "
                             f"{CPU_SECONDS_ENV}=<seconds>") from None
