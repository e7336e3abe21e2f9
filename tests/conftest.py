"""Test-wide set-up.

Triton kernels run on the CPU through Triton's interpreter, which must be chosen before
``triton`` is first imported; the generated modules import it lazily, so setting the variable
here, before any test module loads, is enough.  With ``BAMGEN_TEST_DEVICE=cuda`` the kernels
compile for the GPU instead (``make gpu-check``).
"""
import os
import sys
from pathlib import Path

# BAMGEN_TEST_DEVICE=cuda (make gpu-check) runs tests/runtime/test_properties.py on a real GPU instead.
if os.environ.get("BAMGEN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_runtest_logreport(report):
    """With BAMGEN_FAILURES_AT_ONCE=1 a failed test prints its id and the end of its error as it
    fails, not only in pytest's closing summary: `make gpu-check` kills a step at its time limit,
    and a killed run prints no summary (an H100's property step showed two failures and no
    name). The tail ends with a line `END FAILED <id>`, so gpu-check's report keeps each cause.
    Under pytest-xdist the controller runs this hook for every worker's report (the workers run
    it too, but their output goes nowhere)."""
    if report.failed and os.environ.get("BAMGEN_FAILURES_AT_ONCE") == "1":
        tail = report.longreprtext.strip().splitlines()[-FAILURE_LINES:]
        sys.stdout.write(f"\nFAILED {report.nodeid} ({report.when})\n" + "\n".join(tail)
                         + f"\n{FAILURE_END} {report.nodeid}\n")
        sys.stdout.flush()


FAILURE_LINES = 40   # the end of an error: the assertion, and hypothesis's falsifying example
FAILURE_END = "END FAILED"   # closes a failure's tail, for benchmarks/gpu_check.py to keep it whole
