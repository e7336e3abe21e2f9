"""Test-wide set-up.

Triton kernels run on the CPU through Triton's interpreter, which must be chosen before
``triton`` is first imported; the generated modules import it lazily, so setting the variable
here, before any test module loads, is enough.
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
