"""Every figure the README and docs/training.md quote is one docs/benchmarks.md records (and
not on a line it marks as superseded): the figures live there, the rest link to them."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: a ratio or percentage (``14.8x``, ``+0.25%``, ``11.9x-17.7x``) or a grouped count (``1,461``)
FIGURE = re.compile(r"(?<![\w.])[+-]?\d[\d,]*(?:\.\d+)?(?:x|%)(?:-\d[\d,]*(?:\.\d+)?(?:x|%)?)?"
                    r"(?!\w)|(?<![\w.,])\d{1,3}(?:,\d{3})+(?![\d,])")


def figures(text: str) -> set[str]:
    """The figures of a Markdown text; code (blocks and spans) and link targets left out."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return set(FIGURE.findall(text))


def recorded() -> str:
    lines = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    return "\n".join(line for line in lines if "supersed" not in line.lower())


def test_the_pattern_finds_figures_and_leaves_other_numbers():
    found = figures("L3 keeps 14.8x fewer (ActNN: 12x), +0.25% and 11.9x-17.7x; 1,461 "
                    "samples at 512 tokens, version 2.13.0, [a](b.md#v1-2x)")
    assert found == {"14.8x", "12x", "+0.25%", "11.9x-17.7x", "1,461"}


@pytest.mark.parametrize("doc", ["README.md", "docs/training.md"])
def test_every_quoted_figure_is_recorded_in_benchmarks(doc):
    quoted = figures((ROOT / doc).read_text())
    assert quoted, f"{doc} quotes no figure: is the pattern broken?"
    missing = sorted(f for f in quoted if f not in recorded())
    assert not missing, f"{doc} quotes figures docs/benchmarks.md does not record: {missing}"
