"""The build driver: runs the compiler and the checks, then writes the module (build.py), into a
folder or into bamgen.load's cache (cache.py, loader.py), atomically and under a lock
(files.py); `--standalone` inlines the runtime (standalone.py)."""
