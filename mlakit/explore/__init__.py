"""The offline explorer page: one self-contained HTML file written from a template."""

from mlakit.explore.writer import explorer_inputs, render_explorer, write_explorer

__all__ = ["explorer_inputs", "render_explorer", "write_explorer"]
