"""The process layout the vLLM tests run vLLM in: this tree's mlakit, and this tree's entry points.

vLLM finds its plugins through `importlib.metadata.entry_points()`, which takes the first `mlakit`
metadata on `sys.path`. With the tree on the path, a `mlakit.egg-info` left in the checkout by an
earlier editable install (ignored by git, written before the vLLM entry points existed) wins over the
venv's own metadata: vLLM then loads no mlakit plugin at all (its stock CPU platform, CPU_MLA for
`CUSTOM`), and an install made from another tree names that tree's plugins. So each vLLM process here
gets a metadata folder written from this tree's pyproject.toml first on its path, and a working
directory that holds no metadata of its own (`python -c` puts the working directory first on the path).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def tree_metadata(folder: Path) -> Path:
    """Write `mlakit-VERSION.dist-info` (METADATA, entry_points.txt) from ROOT/pyproject.toml into
    `folder`; return `folder` (put it first on PYTHONPATH)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = dict(project.get("entry-points", {}))
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    info = folder / f"{project['name']}-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    lines = []
    for group, names in groups.items():
        lines += [f"[{group}]", *(f"{name} = {value}" for name, value in names.items()), ""]
    (info / "entry_points.txt").write_text("\n".join(lines))
    return folder


def tree_pythonpath(folder: Path) -> str:
    """PYTHONPATH for a vLLM process: this tree's metadata, the tree, then tests/vllm (driver helpers)."""
    return os.pathsep.join((str(folder), str(ROOT), str(HERE)))
