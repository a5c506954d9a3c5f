"""The README, its guide pages and the results pages point at things that exist: files they
link, modules their commands run, and the config options their commands name."""

import importlib.util
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The guide: the README and the pages it hands detail to (docs/*.md); then the results pages
GUIDE = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGES = [*GUIDE, *sorted((ROOT / "docs" / "results").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
MODULE = re.compile(r"python -m ([\w.]+)")
OPTION = re.compile(r"(?<![\w.])(drafter|tree|target|experiment)=([\w/]+)(?=[\s'\"]|$)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    text = page.read_text()
    missing = [link for link in LINK.findall(text) if "://" not in link
               and not (page.parent / unquote(link)).exists()]
    assert not missing, f"{page.name} links to missing files: {missing}"


def _guide_text() -> str:
    return "\n".join(page.read_text() for page in GUIDE)


def test_every_command_module_in_the_readme_exists():
    modules = set(MODULE.findall(_guide_text()))
    assert "experiments.bench" in modules
    missing = [m for m in sorted(modules) if m not in ("pytest",)
               and importlib.util.find_spec(m) is None]
    assert not missing


def test_every_config_option_the_readme_names_exists():
    options = set(OPTION.findall(_guide_text()))
    assert ("drafter", "eagle3") in options
    missing = [f"{g}={o}" for g, o in sorted(options)
               if not (ROOT / "conf" / g / f"{o}.yaml").is_file()]
    assert not missing


def test_the_guides_examples_decode_on_the_step_the_target_was_loaded_with():
    """`generate(target.model, ...)` would decode on the eager step whatever `target.step` is
    (the loop takes a step, a bare model only through its eager one)."""
    text = _guide_text()
    assert "generate(target.step" in text
    assert not re.findall(r"(?:generate|generate_batch|TreeVerifier)\(target\.model", text)


def test_the_readme_stays_a_guide_of_at_most_450_lines():
    """Detail goes to the pages it links (docs/*.md), not into the README itself."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 450, f"README.md has {lines} lines: move detail to docs/"
