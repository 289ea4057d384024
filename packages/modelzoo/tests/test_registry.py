"""Registry contents, lookups, out-of-tree cards, the support table page and the CLI."""

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from torchmind_modelzoo import CardError, Category, Status, registry
from torchmind_modelzoo.cli import app
from torchmind_modelzoo.table import END, START, render_markdown

CARDS_PAGE = Path(__file__).resolve().parents[3] / "docs" / "modelzoo" / "cards.md"
"""The docs page that holds the support table (the README links to it)."""


CARD_FILES = Path(__file__).resolve().parents[1] / "src" / "torchmind_modelzoo" / "cards"
"""The shipped card files in the source tree, read as plain YAML by the count tests."""


def _raw_cards() -> list[tuple[str, dict]]:
    """(category folder, parsed YAML) of every card file: not through the registry's loader."""
    cards = [
        (path.parent.name, yaml.safe_load(path.read_text()))
        for path in CARD_FILES.rglob("*")
        if path.suffix == ".yaml"
    ]
    assert cards, f"no card files under {CARD_FILES.name}"
    return cards


def test_exact_card_counts():
    """The registry holds exactly the card files: 100, per category folder as many as files
    there, and as many full cards as files saying status: full, each with convert/example/tiny."""
    raw = _raw_cards()
    assert len(raw) == 100
    assert all(card["category"] == folder for folder, card in raw)
    cards = registry.list()
    assert len(cards) == len(raw)
    counts = Counter(c.category.value for c in cards)
    assert counts == Counter(folder for folder, _ in raw)
    assert set(counts) == {c.value for c in Category}
    documented = {"llm": 30, "vlm": 20, "image-generation": 12, "video-generation": 16}
    assert counts == documented | {"speech": 10, "embedding": 12}  # the README's sizes
    full = registry.list(status="full")
    assert {c.id for c in full} == {card["id"] for _, card in raw if card["status"] == "full"}
    assert all(c.convert is not None and c.example is not None and c.tiny for c in full)


def test_ids_are_unique_and_files_match():
    ids = [c.id for c in registry.list()]
    assert len(set(ids)) == len(ids)
    for card in registry.list():
        assert registry.source_of(card.id) == f"{card.category.value}/{card.id}.yaml"


def test_every_shipped_card_passes_the_library_check():
    """Installed transformers / diffusers have every non-remote architecture class."""
    import diffusers  # noqa: F401  (test group: a missing library fails, never skips)
    import transformers  # noqa: F401  (test group: a missing library fails, never skips)

    skipped = registry.validate_all()
    reasons = {k: v for k, v in skipped.items() if v}
    # Remote-code classes and packages outside the pinned set are the only skips.
    assert all("remote code" in r or "is not installed" in r for r in reasons.values())
    # Checked: every card file neither marked remote_code nor of a package not installed here.
    checkable = {
        card["id"]
        for _, card in _raw_cards()
        if not card.get("remote_code", False)
        and importlib.util.find_spec(card["library"].removeprefix("other:").replace("-", "_"))
    }
    assert {name for name, reason in skipped.items() if not reason} == checkable
    assert len(checkable) >= 80, "most cards are of the installed transformers / diffusers"


def test_get_and_filtered_list():
    card = registry.get("wan2.2-t2v-a14b")
    assert card.architecture == "WanTransformer3DModel"
    assert card.example.expert_boundary == 0.875
    video = registry.list(category=Category.VIDEO, status=Status.FULL)
    assert {c.id for c in video} >= {"wan2.1-t2v-1.3b", "wan2.2-ti2v-5b"}
    assert all(c.category is Category.VIDEO and c.status is Status.FULL for c in video)
    assert registry.list("llm") == registry.list(category=Category.LLM)


def test_unknown_name_suggests_close_ids():
    with pytest.raises(KeyError, match="did you mean qwen3-8b"):
        registry.get("qwen3-8")


def test_register_out_of_tree_card(tmp_path):
    data = registry.get("qwen3-8b").model_dump(mode="json", exclude_none=True)
    data["id"] = "my-qwen3"
    path = tmp_path / "my-qwen3.yaml"
    path.write_text(yaml.safe_dump(data))
    try:
        card = registry.register(path)
        assert registry.get("my-qwen3") is card
        assert card in registry.list(category="llm")
        with pytest.raises(ValueError, match="already registered"):
            registry.register(path)
    finally:
        registry.unregister("my-qwen3")
    with pytest.raises(KeyError):
        registry.get("my-qwen3")


def test_register_rejects_invalid_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump({"id": "broken", "category": "llm"}))
    with pytest.raises(CardError, match=r"broken\.yaml: field 'hub_id'"):
        registry.register(path)


def test_support_table_page_is_current():
    """Fails when cards changed without
    `modelzoo list --format markdown --readme docs/modelzoo/cards.md`."""
    text = CARDS_PAGE.read_text()
    block = text[text.index(START) + len(START) + 1 : text.index(END)]
    assert block == render_markdown(registry.list())


def test_cli_list_json_show_and_validate():
    runner = CliRunner()
    out = runner.invoke(app, ["list", "--format", "json", "--category", "speech"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)
    assert len(rows) == 10 and {r["category"] for r in rows} == {"speech"}
    shown = runner.invoke(app, ["show", "bge-m3"])
    assert shown.exit_code == 0 and "architecture: XLMRobertaModel" in shown.output
    missing = runner.invoke(app, ["show", "no-such-model"])
    assert missing.exit_code != 0 and "no model card 'no-such-model'" in missing.output


def test_cli_validate_reports_bad_extra_card(tmp_path):
    import transformers  # noqa: F401  (test group: a missing library fails, never skips)

    data = registry.get("qwen3-8b").model_dump(mode="json", exclude_none=True)
    data |= {"id": "bad-arch", "architecture": "NotAModel"}
    path = tmp_path / "bad-arch.yaml"
    path.write_text(yaml.safe_dump(data))
    runner = CliRunner()
    try:
        out = runner.invoke(app, ["validate", str(path)])
    finally:
        registry.unregister("bad-arch")
    assert out.exit_code == 1
    assert "field 'architecture'" in out.output and "NotAModel" in out.output


_BLOCK_EXTRAS = """
import importlib.abc, importlib.util, sys
BLOCKED = ("transformers", "diffusers", "liteboost")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(name)
sys.meta_path.insert(0, Block())
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda n, *a: None if n.split(".")[0] in BLOCKED else find_spec(n, *a)
from torchmind_modelzoo.cli import main
sys.argv = ["modelzoo", *sys.argv[1:]]
main()
"""


def test_cli_lists_and_validates_without_model_libraries():
    """With transformers, diffusers and liteboost unimportable, list/validate still work and
    run names the extra to install."""
    import subprocess
    import sys

    def cli(*args):
        cmd = [sys.executable, "-c", _BLOCK_EXTRAS, *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    listed = cli("list", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    assert len(json.loads(listed.stdout)) == 100
    checked = cli("validate")
    assert checked.returncode == 0 and "library class checked for 0" in checked.stdout
    ran = cli("run", "qwen3-0.6b", "--tiny")
    assert ran.returncode == 1 and "torchmind-modelzoo[transformers]" in ran.stderr, ran.stderr
