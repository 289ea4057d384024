"""The support table: cards rendered as Markdown, and the page block it lives in.

The table lives in ``docs/modelzoo/cards.md`` between the two marker lines; ``modelzoo list
--format markdown --readme docs/modelzoo/cards.md`` rewrites it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from npu_core.files import write_text_atomic
from torchmind_modelzoo.schema import Category, ModelCard, Status

START = "<!-- modelzoo:support-table:start -->"
END = "<!-- modelzoo:support-table:end -->"

_TITLES = {
    Category.LLM: "LLM",
    Category.VLM: "VLM / omni",
    Category.IMAGE: "Image generation",
    Category.VIDEO: "Video generation",
    Category.SPEECH: "Speech (ASR / TTS)",
    Category.EMBEDDING: "Embedding / rerank",
}


def _params(card: ModelCard) -> str:
    total = f"{card.params_b:g}"
    return f"{total} ({card.active_params_b:g} active)" if card.active_params_b else total


def render_markdown(cards: Sequence[ModelCard]) -> str:
    """One table per category plus a count line; the order of ``cards`` is kept."""
    full = sum(c.status is Status.FULL for c in cards)
    lines = [
        f"{len(cards)} models, {full} full (convert + example), {len(cards) - full} listed.",
        "",
    ]
    for category in Category:
        rows = [c for c in cards if c.category is category]
        if not rows:
            continue
        lines += [
            f"### {_TITLES[category]} ({len(rows)})",
            "",
            "| Model | Hub id | Architecture | Params (B) | License | Precision | Status |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in rows:
            status = f"**{c.status.value}**" if c.status is Status.FULL else c.status.value
            arch = f"{c.architecture} (remote code)" if c.remote_code else c.architecture
            lines.append(
                f"| {c.id} | {c.hub_id} | {arch} | {_params(c)} | {c.license} | "
                f"{c.precision} | {status} |"
            )
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def replace_block(text: str, table: str) -> str:
    """``text`` with the block between the markers replaced by ``table``.

    Raises:
        ValueError: when the markers are missing or out of order.
    """
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no {START} ... {END} block to fill")
    return text[: start + len(START)] + "\n" + table + text[end:]


def update_readme(path: str | os.PathLike[str], table: str) -> bool:
    """Rewrite the support-table block of the page at ``path`` atomically; True when it changed."""
    path = Path(path)
    old = path.read_text(encoding="utf-8")
    new = replace_block(old, table)
    if new == old:
        return False
    write_text_atomic(path, new)
    return True
