"""Each package's ``__init__`` docstring carries a file map (issue #66 item 5), and the map is current.

A map line is a docstring line that starts with a module file ``x.py`` or a folder ``x/`` followed by
``: `` and a few words. For every package under peer/, protocol/ and bootstrap/: every module file
(``__init__.py`` aside) and every sub-package has exactly one map line, and every name a map line
gives exists in that package's folder (a folder of package data, such as peer/assets/, may be mapped
too). The docstring is read with `ast`, not by importing.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROOTS = ("peer", "protocol", "bootstrap")
MAP_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.py|/)): \S")


def _packages() -> list[Path]:
    return sorted(init.parent for name in ROOTS for init in (ROOT / name).rglob("__init__.py"))


def _expected(package: Path) -> set[str]:
    names = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    names |= {p.name + "/" for p in package.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    return names


def _mapped(package: Path) -> list[str]:
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    return [m.group(1) for line in doc.splitlines() if (m := MAP_LINE.match(line))]


def test_every_folder_with_modules_is_a_package():
    """A folder of modules without ``__init__.py`` would escape the map check below."""
    loose = sorted(
        str(d.relative_to(ROOT))
        for name in ROOTS
        for d in {p.parent for p in (ROOT / name).rglob("*.py")}
        if "__pycache__" not in d.parts and not (d / "__init__.py").is_file()
    )
    assert not loose, f"folders with modules but no __init__.py: {loose}"


@pytest.mark.parametrize("package", _packages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_package_docstring_maps_its_files(package: Path):
    mapped = _mapped(package)
    where = f"{package.relative_to(ROOT)}/__init__.py"
    twice = sorted({name for name in mapped if mapped.count(name) > 1})
    assert not twice, f"{where}: mapped more than once: {twice}"
    missing = sorted(_expected(package) - set(mapped))
    assert not missing, f"{where}: no map line (`name.py: what it holds`) for {missing}"
    stale = sorted(name for name in mapped if not (package / name.rstrip("/")).exists())
    assert not stale, f"{where}: map names files that do not exist: {stale}"
