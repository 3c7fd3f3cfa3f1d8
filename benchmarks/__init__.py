"""kvcore's performance scripts; results are recorded in ``docs/benchmarks.md``.

Each runs from the repository root as a module, ``python -m benchmarks.<name> --help``, so
that ``kvcore``, ``harness`` (the engine stacks the tests build too) and the scripts' shared
modules import by name; no script changes the import path.
"""
