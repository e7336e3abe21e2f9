"""The checks that run the compiler's printed code before a module is written: the formula over
its whole domain, in the dtypes the module computes in (scan.py over numeric.py's grids)."""
