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


TICKS = """
await new Promise((r) => setTimeout(r, 0));
const out = {};
for (const id of ['v4-flops', 'v4-bytes']) {
  const svg = document.getElementById(id);
  out[id] = {
    ticks: [...svg.querySelectorAll('text.v4-ytick')].map(
      (t) => [Number(t.dataset.value), t.textContent, Number(t.dataset.y)]),
    label: svg.querySelector('text.v4-ylabel').textContent,
    ys: [...svg.querySelectorAll('polyline')].flatMap(
      (p) => p.getAttribute('points').split(' ').map((xy) => Number(xy.split(',')[1]))),
  };
}
return out;
"""


@pytest.mark.parametrize("model", ["deepseek-v4-pro", "deepseek-v4-flash"])
def test_v4_log_charts_have_y_ticks_with_units(page, model):  # noqa: F811
    import math
    import re

    set_control(page, "v4-model", model)
    set_control(page, "context", 131072)
    got = page.execute_script(TICKS)
    units = {"v4-flops": ("FLOP", "FLOPs / decoded token"), "v4-bytes": ("B", "cache bytes / token")}
    for chart, (unit, label) in units.items():
        ticks = got[chart]["ticks"]
        assert got[chart]["label"] == label and len(ticks) >= 3, (chart, ticks)
        for value, text, _ in ticks:
            mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
            assert round(mantissa, 6) in (1, 2, 5), (chart, value)
            assert re.fullmatch(rf"[0-9.]+ [kMGTPE]?{unit}", text), (chart, text)
        ys = [y for _, _, y in ticks]
        assert ys == sorted(ys, reverse=True)  # a larger value sits higher on the page
        # the ticks lie within the plotted lines' span
        assert min(got[chart]["ys"]) - 1 <= min(ys) and max(ys) <= max(got[chart]["ys"]) + 1
