"""Run the ``## Quick start`` section of a package README, as a user who just installed it would.

Usage: ``python tools/quickstart.py packages/<member>/README.md [--find-links DIR]``, with the
Python of the environment that holds the installed wheel. Each fenced ``python`` block runs with
that Python; each line of a fenced ``bash`` block runs in bash with that environment's ``bin``
first on ``PATH``. A ``pip install`` line (an extra, say) runs with that Python's pip and the
wheels of ``--find-links`` beside the package index, so the workspace's own wheels are found.
Everything runs in one fresh temporary folder (so files one step writes are there for the next),
and the first failing step stops the run with its exit code. Uses only the standard library: it
runs in environments that hold nothing but the wheel under test.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
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


def _pip_install(line: str, find_links: str | None) -> list[str] | None:
    """``pip install ...`` as this environment's pip, with the local wheels; else None."""
    words = shlex.split(line)
    if words[:2] != ["pip", "install"]:
        return None
    links = ["--find-links", find_links] if find_links else []
    return [sys.executable, "-m", "pip", "install", "--quiet", *links, *words[2:]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("readme", type=Path)
    parser.add_argument("--find-links", help="folder of locally built wheels")
    args = parser.parse_args()
    blocks = quick_start_blocks(args.readme.read_text())
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    with tempfile.TemporaryDirectory(prefix="quickstart-") as work:
        for language, code in blocks:
            if language == "python":
                steps = [[sys.executable, "-c", code]]
            else:
                lines = [line for line in code.splitlines() if line.strip()]
                steps = [
                    _pip_install(line, args.find_links) or ["bash", "-euo", "pipefail", "-c", line]
                    for line in lines
                ]
            for step in steps:
                shown = "<python block>" if language == "python" else shlex.join(step)
                print(f"quickstart: {shown}", flush=True)
                done = subprocess.run(step, cwd=work, env=env, check=False)
                if done.returncode != 0:
                    print(f"quickstart: failed with exit code {done.returncode}", file=sys.stderr)
                    return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
