"""Benchmark: start-up time, blocking torch.distributed init versus mccl (see mccl.bench).

Run through ``nox -s bench``, or directly: ``python packages/mccl/benchmarks/startup.py --out DIR``.
"""

from mccl.cli import app

if __name__ == "__main__":
    app(["bench", *__import__("sys").argv[1:]])
