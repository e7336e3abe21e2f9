"""The GPU path: Triton kernels written once for every prior (helpers.py, forward.py, backward.py,
decode.py), instantiated per prior with its hooks and flags (variant.py), and their host side
(launch.py). Importing this package does not import Triton: a CPU user never pays for it."""
import os


def interpreting() -> bool:
    """Whether Triton runs its interpreter (TRITON_INTERPRET=1: the kernels on the CPU, as the
    tests run them)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
