"""The package's structure holds: no import cycle between its modules or its rooms, no file over the
size cap, and an install that puts nothing but ``remat_compiler`` into site-packages
(:mod:`benchmarks.structure_check` measures the first two; it reads the source and runs nothing)."""
from __future__ import annotations

import tomllib
from pathlib import Path

from benchmarks.structure_check import MAX_LINES, ROOTS, measure

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_graph_has_no_cycle_between_modules_or_rooms():
    s = measure(ROOT)
    assert s.modules.number_of_nodes() > 50  # the whole package was read
    assert s.cycles(s.modules) == []
    assert s.cycles(s.groups) == []


def test_no_file_of_the_package_or_its_passes_is_over_the_size_cap():
    s = measure(ROOT)
    assert any(path.startswith("passes/") for path in s.lines)
    assert s.over(MAX_LINES) == {}


def test_the_install_names_only_the_remat_compiler_namespace_and_every_package_of_it():
    """pyproject lists the packages (passes/ and examples/ mapped under remat_compiler): every folder
    with an ``__init__.py`` is installed, and no top-level name but remat_compiler is."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    assert {name.split(".")[0] for name in listed} == {"remat_compiler"}
    assert tool["package-dir"] == {k: v for k, v in ROOTS.items() if k != "remat_compiler"}
    on_disk = set()
    for prefix, folder in ROOTS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            on_disk.add(".".join([prefix, *init.parent.relative_to(ROOT / folder).parts]))
    assert listed == on_disk
