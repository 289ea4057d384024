"""MkDocs hooks of the docs site: the results, floors and snippets tables of each page, rendered
from the repository by ``tools/docs_tables.py``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from docs_tables import expand_markers


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Replace each ``<!-- results: FILE -->``, ``<!-- floors: MEMBER -->`` and
    ``<!-- snippets: MEMBER -->`` marker with what it names."""
    return expand_markers(markdown)
