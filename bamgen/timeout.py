"""A wall-clock bound on one build, so a hostile formula cannot keep SymPy busy for ever."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


class BuildTimeout(Exception):
    """The build ran past its time limit."""


@contextmanager
def time_limit(seconds: float):
    """Raise BuildTimeout in this block after ``seconds`` (main thread only; else no limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise BuildTimeout(f"build exceeded {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
