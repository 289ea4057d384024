"""Run the ``## Quick start`` section of a package README, as a user who just installed it would.

Usage: ``python tools/quickstart.py packages/<member>/README.md``, with the Python of the
environment that holds the installed wheel. Each fenced ``python`` block runs with that Python;
each line of a fenced ``bash`` block runs in bash with that environment's ``bin`` first on
``PATH``. Everything runs in one fresh temporary folder (so files one step writes are there for
the next), and the first failing step stops the run with its exit code. Uses only the standard
library: it runs in environments that hold nothing but the wheel under test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.M | re.S)


def quick_start_blocks(readme: str) -> list[tuple[str, str]]:
    """The ``(language, code)`` fences of the README's ``## Quick start`` section, in order."""
    section = re.search(r"^## Quick start\s*$(.*?)(?=^## |\Z)", readme, re.M | re.S)
    if section is None:
        raise SystemExit("README has no '## Quick start' section")
    blocks = [(m.group(1), m.group(2)) for m in FENCE.finditer(section.group(1))]
    runnable = [(lang, code) for lang, code in blocks if lang in ("python", "bash")]
    if not runnable:
        raise SystemExit("the Quick start section has no python or bash block")
    return runnable


def main() -> int:
    (readme_path,) = sys.argv[1:]
    blocks = quick_start_blocks(Path(readme_path).read_text())
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    with tempfile.TemporaryDirectory(prefix="quickstart-") as work:
        for language, code in blocks:
            if language == "python":
                steps = [[sys.executable, "-c", code]]
            else:
                lines = [line for line in code.splitlines() if line.strip()]
                steps = [["bash", "-euo", "pipefail", "-c", line] for line in lines]
            for step in steps:
                shown = step[-1] if language == "bash" else "<python block>"
                print(f"quickstart: {shown}", flush=True)
                done = subprocess.run(step, cwd=work, env=env, check=False)
                if done.returncode != 0:
                    print(f"quickstart: failed with exit code {done.returncode}", file=sys.stderr)
                    return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
