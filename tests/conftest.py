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
