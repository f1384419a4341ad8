"""docs/architecture.md is true to the code, row for row: every module of the library has
exactly one row of the layer table (a package row such as `simulate/` may name its modules
in its description), every module a row names exists, every Slurm template and every
`python -m mpistrat` command is named, and no document points at a file outside the
repository."""

import collections
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()


def _rows():
    for line in DOC.splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 3 and not set(cells[2].strip()) <= set("-"):
            yield cells[2], cells[3]


def _named():
    """Module path (below mpistrat/) -> how many rows name it."""
    named = collections.Counter()
    for name_cell, description in _rows():
        for path in re.findall(r"`([\w/]+\.py)`", name_cell):
            named[path] += 1
        for package in re.findall(r"`([\w]+)/`", name_cell):      # a package of ours
            if (ROOT / "mpistrat" / package).is_dir():
                for module in set(re.findall(r"`(\w+\.py)`", description)):
                    named[f"{package}/{module}"] += 1
    return named


MODULES = sorted(str(p.relative_to(ROOT / "mpistrat")) for p in (ROOT / "mpistrat").rglob("*.py")
                 if p.name != "__init__.py")


def test_every_module_has_exactly_one_row():
    named = _named()
    assert [m for m in MODULES if named[m] == 0] == []          # a module no row explains
    assert [m for m in MODULES if named[m] > 1] == []           # rows that say it twice


def test_every_module_a_row_names_exists():
    library = {str(p.relative_to(ROOT / "mpistrat")) for p in (ROOT / "mpistrat").rglob("*.py")}
    outside = {p for p in _named() if p not in library and not (ROOT / p).exists()}
    assert outside == set()


def test_every_slurm_template_and_command_is_named():
    templates = sorted(p.name for p in (ROOT / "slurm").glob("*.sbatch"))
    assert templates and [t for t in templates if f"`{t}`" not in DOC] == []
    main = (ROOT / "mpistrat" / "__main__.py").read_text()
    commands = re.search(r'choices=\[([^\]]+)\]', main).group(1)
    for command in re.findall(r'"(\w+)"', commands):
        assert f"`{command}`" in DOC, command


def test_documents_cite_only_files_of_the_repository():
    """Before, the docs cited a design file kept outside the repository."""
    for doc in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        text = doc.read_text()
        assert "../shared" not in text and "DESIGN.md" not in text, doc.name
