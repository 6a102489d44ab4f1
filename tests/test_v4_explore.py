"""The explorer's V4 panel (mlakit/explore/v4.js) equals mlakit.cost.v4, in real headless Chromium."""

from __future__ import annotations

import pytest

from mlakit.cost.v4 import compare, layer_terms
from mlakit.v4.config import V4Config
from tests.test_explore import driver, page, page_url, set_control  # noqa: F401  (fixtures)

READ = """
const rows = {};
for (const tr of document.querySelectorAll('#v4-body tr'))
  rows[tr.dataset.model] = [Number(tr.dataset.macs), Number(tr.dataset.cacheBytesPerSequence)];
const terms = [...document.querySelectorAll('#v4-terms-body tr')].map(
  (tr) => [tr.dataset.kind, tr.dataset.term, Number(tr.dataset.macs), Number(tr.dataset.bytes)]);
return {rows, terms, lines: document.querySelectorAll('#v4-flops polyline').length};
"""


@pytest.mark.parametrize("model", ["deepseek-v4-pro", "deepseek-v4-flash"])
def test_v4_panel_equals_cost_model(page, model):  # noqa: F811
    set_control(page, "v4-model", model)
    cfg = V4Config.preset(model)
    for context in (100, 8192, 131072, 1 << 20):
        for dtype in ("bf16", "fp8"):
            set_control(page, "context", context)
            set_control(page, "dtype", dtype)
            got = page.execute_script("await new Promise((r) => setTimeout(r, 0));" + READ)
            want = compare(cfg, context, 1, dtype)
            assert set(got["rows"]) == set(want)
            for name, (macs, seq) in got["rows"].items():
                assert macs == want[name]["macs"], (name, context, dtype)
                assert seq == want[name]["cache_bytes_per_sequence"], (name, context, dtype)
            for kind, term, macs, nbytes in got["terms"]:
                t = layer_terms(cfg, kind, context, 1, dtype)[term]
                assert (macs, nbytes) == (t["macs"], t["bytes"]), (kind, term, context, dtype)
            assert got["lines"] == 3
