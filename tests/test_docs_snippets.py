"""Every ```python block of README.md and docs/*.md runs as written (the blocks of one file in order,
sharing names, as a reader pasting them would; each README block on its own, as a reader trying one
would). A block whose first line is `# not run: <why>` is skipped with that reason (for what needs
torchrun or a real checkpoint)."""

from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
SKIP = "# not run:"
ALONE = {"README.md"}  # every block runs in a fresh namespace: each carries its own imports


def blocks(doc: str) -> list[str]:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return BLOCK.findall(f.read())


DOCS_WITH_CODE = [d for d in DOCS if blocks(d)]


def test_the_readme_has_python_to_run():
    assert any(not b.startswith(SKIP) for b in blocks("README.md"))


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS_WITH_CODE, ids=DOCS_WITH_CODE)
def test_snippets_run_as_written(doc, tmp_path, monkeypatch):
    import torch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("MLAKIT_CACHE_DIR", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny layers: extra threads only spin on a shared machine
    namespace: dict = {"__name__": "__snippet__"}
    ran = 0
    try:
        for i, code in enumerate(blocks(doc)):
            if code.startswith(SKIP):
                continue
            if doc in ALONE:
                namespace = {"__name__": "__snippet__"}
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                exec(compile(code, f"{doc} python block {i + 1}", "exec"), namespace)
            ran += 1
    finally:
        torch.set_num_threads(threads)
    if not ran:
        pytest.skip(f"every python block of {doc} is marked '{SKIP}'")


@pytest.mark.parametrize("doc", DOCS_WITH_CODE, ids=DOCS_WITH_CODE)
def test_skipped_blocks_say_why(doc):
    for code in blocks(doc):
        if code.startswith(SKIP):
            assert len(code.splitlines()[0]) > len(SKIP) + 3, f"{doc}: '{SKIP}' needs a reason"
