"""A launcher job for the signal tests: two ranks record their pids, then wait to be stopped.

Run as ``python _signalled_job.py OUT_DIR``; the test signals this process and checks that no
rank (nor the forkserver they came from) outlives it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from npu_core.dist import launch


def _record_and_wait(out_dir: str) -> None:
    rank = os.environ["RANK"]
    path = Path(out_dir) / f"rank{rank}.pids"
    path.with_suffix(".tmp").write_text(f"{os.getpid()} {os.getppid()}")
    path.with_suffix(".tmp").rename(path)  # complete or absent, for the poller
    time.sleep(120)


if __name__ == "__main__":
    launch(_record_and_wait, 2, sys.argv[1], timeout=300, backend=None)
