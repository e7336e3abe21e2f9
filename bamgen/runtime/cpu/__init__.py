"""The torch path (backend="torch"; the CPU's): forward.py, backward.py and the decode step
(decode.py) over common.py's tiles and threads, calling the prior's printed torch code through
hooks.py (docs/architecture.md, "CPU path")."""
