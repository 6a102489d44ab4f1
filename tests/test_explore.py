"""The explorer page: self-contained, fed inputs only, and equal to mlakit.cost in real headless Chromium."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile

import pytest

from mlakit import cost
from mlakit.config import PRESETS, MLAConfig
from mlakit.explore import explorer_inputs, render_explorer, write_explorer

CONTEXTS = (512, 4096, 65536, 1_000_000)
WIDTH_FIELDS = (
    "num_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "num_layers",
    "hidden_size",
    "q_lora_rank",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
)
INDEX_FIELDS = ("index_n_heads", "index_head_dim", "index_topk")
DENSE = dict.fromkeys(INDEX_FIELDS, 0)  # the page's custom widths: top-k 0 is dense MLA
CUSTOM = {  # odd widths, and one with 2L < nope + v (no long-context crossover)
    "odd": dict(
        num_heads=6,
        kv_lora_rank=40,
        qk_nope_head_dim=24,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_layers=3,
        hidden_size=64,
        q_lora_rank=0,
        **DENSE,
    ),
    "wide-heads": dict(
        num_heads=4,
        kv_lora_rank=64,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_layers=2,
        hidden_size=96,
        q_lora_rank=32,
        **DENSE,
    ),
}
SPARSE_CUSTOM = {  # odd DSA widths: k 9, and an indexer that costs more per key than attention
    "tiny-dsa": dict(
        num_heads=6,
        kv_lora_rank=40,
        qk_nope_head_dim=24,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_layers=3,
        hidden_size=64,
        q_lora_rank=24,
        index_n_heads=3,
        index_head_dim=20,
        index_topk=9,
    ),
    "heavy-indexer": dict(
        num_heads=2,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        num_layers=2,
        hidden_size=32,
        q_lora_rank=8,
        index_n_heads=8,
        index_head_dim=130,
        index_topk=5,
    ),
}
MEASURED = {"name": "bench-box", "peak_flops": {"fp32": 8.9e10, "bf16": 8.9e10}, "memory_bandwidth": 1.6e10}


def bench_results() -> dict:
    """Synthetic timings for deepseek-v3 with a known shape: absorb grows faster with new tokens."""
    rows = []
    for batch, (fa, fm) in ((1, (1.0, 1.0)), (8, (8.0, 4.0))):
        for cached in (1024, 4096, 32768):
            k = cached / 1024
            for new in (1, 4, 16, 64, 256, 1024):
                a = fa * (0.05 + 0.002 * new * k)
                m = fm * (0.5 * k + 0.0005 * new * k)
                for backend, ms in (("mlakit-absorb", a), ("mlakit-materialize", m), ("mha", a / 2)):
                    rows.append(
                        dict(backend=backend, batch=batch, new=new, cached=cached, dtype="bf16", ms_median=ms)
                    )
    return {
        "schema": "mlakit-bench-results/1",
        "model": "deepseek-v3",
        "dtype": "bf16",
        "machine": dict(MEASURED, source="synthetic", extra={}),
        "rows": rows,
    }


def preset_or_custom(name: str) -> MLAConfig:
    if name in PRESETS:
        return MLAConfig.preset(name)
    widths = dict({**CUSTOM, **SPARSE_CUSTOM}[name])
    widths["q_lora_rank"] = widths["q_lora_rank"] or None
    if widths["index_topk"]:
        widths["indexer_rope_interleave"] = False  # the layout does not change a cost
    else:
        widths.update(dict.fromkeys(INDEX_FIELDS))
    return MLAConfig(**widths)


# --- the file itself (no browser needed)


def test_page_is_self_contained():
    html = render_explorer(bench_results())
    assert re.findall(r"https?://[^\s\"')]+", html) == [
        "http://www.w3.org/2000/svg"
    ]  # a namespace, never fetched
    assert not re.search(r"<script[^>]*\bsrc=|<link(?![^>]*href=\"data:)|@import|url\(", html)
    assert html.count("</script>") == 2


def test_writer_sends_inputs_not_figures():
    inputs = explorer_inputs()
    assert set(inputs) == {
        "presets",
        "start",
        "machines",
        "counting_default",
        "context_range",
        "new_range",
        "gqa_groups",
        "cache_format",
        "bench",
        "capacity",
        "v4_presets",  # the V4 panel (tests/test_v4_explore.py)
        "v4_fp8_tile",
    }
    assert set(inputs["presets"]) == set(PRESETS)
    for name, widths in inputs["presets"].items():
        assert set(widths) == set(WIDTH_FIELDS)
        cfg = MLAConfig.preset(name)
        assert {f: widths[f] for f in INDEX_FIELDS} == {f: getattr(cfg, f) for f in INDEX_FIELDS}, name
    assert inputs["start"] == {
        "model": "deepseek-v3",
        "context": 4096,
        "counting": "causal",
        "machine": "none",
    }
    assert set(inputs["machines"]) == set(cost.MACHINES) and inputs["context_range"][0] == 1


def test_page_opens_at_a_measured_cell():
    inputs = explorer_inputs(bench_results())
    assert inputs["start"] == {
        "model": "deepseek-v3",
        "context": 32768,
        "counting": "causal",
        "machine": "measured",
    }
    assert inputs["machines"]["measured"]["name"] == "bench-box"
    html = render_explorer()
    for figure in ("163.8", "170.6", "70272", "70,272", "40960"):  # what the page shows on opening
        assert figure not in html


def test_bench_json_cannot_close_the_script():
    results = {"rows": [dict(backend="</script><b>", batch=1, new=1, cached=1, dtype="bf16", ms_median=1.0)]}
    html = render_explorer(results)
    assert html.count("</script>") == 2 and "<\\/script><b>" in html


# --- in headless Chromium


def _chromium() -> tuple[str | None, str | None]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    return browser, shutil.which("chromedriver")


def missing_browser_parts(browser: str | None, driver: str | None) -> str | None:
    """The skip reason naming exactly what is missing (the browser, its driver or both), or None."""
    missing = [name for name, path in (("chromium", browser), ("chromedriver", driver)) if path is None]
    if not missing:
        return None
    packages = {"chromium": "chromium", "chromedriver": "chromium-driver"}
    return (
        f"{' and '.join(missing)} not found on PATH (apt-get install "
        f"{' '.join(packages[m] for m in missing)}; .ci/run does)"
    )


@pytest.fixture(scope="module")
def driver():
    found = _chromium()
    reason = missing_browser_parts(*found)
    if reason is not None:
        pytest.skip(reason)
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="selenium is not installed (pip install -e .[dev])"
    )
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="mlakit-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = found[0]
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1100,1800",
    ):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(options=opts, service=Service(found[1]))
    yield d
    d.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def page_url(tmp_path_factory):
    folder = tmp_path_factory.mktemp("explore")
    results = folder / "results.json"
    results.write_text(json.dumps(bench_results()))
    return "file://" + write_explorer(str(folder / "page.html"), str(results))


def page_errors(log: list[dict]) -> list[dict]:
    """The page's own errors: what its script threw or logged. Chromium's own notes (e.g. "Throttling
    navigation to prevent the browser from hanging", written when a page replaces its URL often) are
    the browser's, not the page's, and come and go with the machine's speed."""
    return [
        e
        for e in log
        if e["level"] == "SEVERE" or (e["level"] == "WARNING" and e.get("source") == "console-api")
    ]


@pytest.fixture
def page(driver, page_url):
    driver.get(page_url)
    yield driver
    errors = page_errors(driver.get_log("browser"))
    assert errors == [], f"console errors: {errors}"


def set_control(d, element_id: str, value) -> None:
    """What a user's edit does: set the value, then fire input and change."""
    d.execute_script(
        "const el = document.getElementById(arguments[0]); el.value = arguments[1];"
        "for (const kind of ['input', 'change']) el.dispatchEvent(new Event(kind, {bubbles: true}));",
        element_id,
        str(value),
    )


def choose_model(d, name: str) -> None:
    if name in PRESETS:
        set_control(d, "model", name)
        return
    set_control(d, "model", "custom")
    for field, value in {**CUSTOM, **SPARSE_CUSTOM}[name].items():
        set_control(d, f"custom-{field}", value)


READ = """
const v = (id) => document.getElementById(id).dataset.value;
const rows = {};
for (const tr of document.querySelectorAll('#cache-body tr')) {
  const r = {};
  for (const td of tr.children) r[td.className] = {value: td.dataset.value, text: td.textContent};
  rows[tr.dataset.kind] = r;
}
const marker = document.getElementById('crossover-marker');
return {
  exact: v('crossover-exact'), limit: v('crossover-limit'),
  exact_text: document.getElementById('crossover-exact').textContent,
  lower: document.getElementById('crossover-exact').dataset.lower,
  upper: document.getElementById('crossover-exact').dataset.upper,
  dense: v('crossover-dense'), dense_text: document.getElementById('crossover-dense').textContent,
  dense_shown: !document.getElementById('crossover-dense').hidden,
  limit_text: document.getElementById('crossover-limit').textContent,
  rows: rows, gqa_equivalent: v('gqa-equivalent'), error: document.getElementById('error').textContent,
  materialize_d: document.getElementById('line-materialize').getAttribute('d'),
  absorb_d: document.getElementById('line-absorb').getAttribute('d'),
  marker_new: marker.dataset.new,
  marker_x: marker.querySelector('line') ? marker.querySelector('line').getAttribute('x1') : null,
  kinds: [...document.querySelectorAll('#cache-body tr')].map((tr) => tr.dataset.kind),
  measured: v('crossover-measured'), predicted: v('crossover-predicted'), bench_cached: v('bench-cached'),
  measured_lines: document.querySelectorAll('[id^=line-measured-]').length,
  context: document.getElementById('context').value, model: document.getElementById('model').value,
  roofline: v('crossover-roofline'), machine: document.getElementById('machine').value,
  hash: location.hash, stale: document.getElementById('chart').classList.contains('stale'),
  dots: [...document.querySelectorAll('#chart circle.dot')]
    .map((c) => [c.dataset.new, c.dataset.ms, c.getAttribute('cy')]),
};
"""


def read(d) -> dict:
    return d.execute_script(READ)


def as_number(text: str) -> float | None:
    return None if text == "none" else float(text)


def assert_tokens(name: str, got_value: str, got_text: str, want: float | None) -> None:
    if want is None:
        assert got_value == "none" and got_text == "none", (
            f"{name}: got {got_value!r} / {got_text!r}, want none"
        )
        return
    got = as_number(got_value)
    assert abs(got - want) <= 1e-9 * max(abs(want), 1.0), f"{name}: got {got!r}, want {want!r}"
    shown = float(got_text.removesuffix(" tokens"))
    assert abs(shown - want) <= 0.05 + 1e-9, f"{name}: shows {got_text!r}, want {want:.1f}"


@pytest.mark.browser
def test_opens_at_the_measured_cell_on_the_measured_machine(page):
    s = read(page)
    assert (s["model"], s["context"], s["machine"]) == ("deepseek-v3", "32768", "measured")
    assert int(s["bench_cached"]) == 32768 and s["measured_lines"] == 2
    set_control(page, "machine", "none")
    set_control(page, "context", 4096)
    set_control(page, "counting", "independent")
    s = read(page)
    assert s["exact_text"] == "163.8 tokens" and s["limit_text"] == "170.7 tokens"
    assert s["rows"]["mla"]["bytes-per-token"]["text"] == "70.3 kB"
    assert s["rows"]["mla"]["values"]["text"] == "576" and s["rows"]["expanded"]["values"]["text"] == "40,960"
    assert float(s["marker_new"]) == pytest.approx(163.84)


@pytest.mark.browser
def test_crossover_box_equals_cost_over_a_grid(page):
    for name in [*PRESETS, *CUSTOM]:
        choose_model(page, name)
        cfg = preset_or_custom(name)
        for context in CONTEXTS:
            set_control(page, "context", context)
            for model in cost.MODELS:
                set_control(page, "counting", model)
                s = read(page)
                want = cost.crossover(cfg, context, model)
                where = f"{name} at {context} ({model})"
                assert s["error"] == "", where
                assert_tokens(f"limit, {where}", s["limit"], s["limit_text"], want.asymptotic)
                if cfg.is_sparse:  # one answer: the sparse band; the dense figure labelled beside it
                    check_sparse_headline(s, cfg, context, model, where)
                    continue
                assert_tokens(f"exact, {where}", s["exact"], s["exact_text"], want.exact)
                assert s["marker_new"] == ("none" if want.exact is None else s["exact"])
                assert not s["dense_shown"], where
    set_control(page, "counting", "causal")


def check_sparse_headline(s: dict, cfg: MLAConfig, context: int, counting: str, where: str) -> None:
    band = cost.sparse_crossover(cfg, context, counting)
    if band is None:
        assert (s["lower"], s["upper"], s["exact_text"]) == ("none", "none", "never"), where
    else:
        assert math.isclose(float(s["lower"]), band[0], rel_tol=1e-8), where
        assert (
            s["upper"] == "none"
            if band[1] is None
            else math.isclose(float(s["upper"]), band[1], rel_tol=1e-8)
        )
        assert "≤ new <" in s["exact_text"], where
    dense = cost.crossover(cfg, context, counting).exact
    assert s["dense_shown"] and "dense layer" in s["dense_text"], where
    assert_tokens(f"dense, {where}", s["dense"], s["dense_text"].split(": ")[-1], dense)
    assert s["marker_new"] == ("none" if dense is None else s["dense"])  # the chart is the dense layer's


@pytest.mark.browser
def test_cache_panel_equals_cost_over_a_grid(page):
    for name in [*PRESETS, *CUSTOM]:
        choose_model(page, name)
        cfg = preset_or_custom(name)
        for context in (512, 1_000_000):
            set_control(page, "context", context)
            for dtype in cost.CACHE_DTYPES:
                set_control(page, "dtype", dtype)
                s = read(page)
                rows = s["rows"]
                want = cost.cache_economics(cfg, context, dtype, gqa_groups=(4, 8))
                assert s["kinds"] == list(want["values_per_token_per_layer"]), f"{name} {dtype}"
                for kind, r in rows.items():
                    where = f"{name} {kind} {dtype} at {context}"
                    assert int(r["values"]["value"]) == want["values_per_token_per_layer"][kind], where
                    assert (
                        int(r["bytes-per-token-per-layer"]["value"])
                        == want["bytes_per_token_per_layer"][kind]
                    ), where
                    for key in ("bytes_per_token", "bytes_per_sequence"):
                        cell = r[key.replace("_", "-")]
                        assert int(cell["value"]) == want[key][kind], where
                        assert cell["text"] == cost.format_bytes(want[key][kind]), where


@pytest.mark.browser
def test_gqa_groups_and_equivalence(page):
    set_control(page, "context", 4096)
    s = read(page)
    assert float(s["gqa_equivalent"]) == 2.25
    assert {"gqa4", "gqa8"} <= set(s["rows"])
    assert page.find_element("id", "gqa-groups").get_attribute("value") == "4,8"
    assert [k for k in s["kinds"] if k.startswith("gqa")] == ["gqa4", "gqa8"]  # the box's groups, no more
    set_control(page, "gqa-groups", 3)  # 128 heads: 3 does not divide them
    s = read(page)
    assert not [k for k in s["kinds"] if k.startswith("gqa")]  # the table lists what the box says
    assert "not defined" in page.find_element("id", "gqa-note").text
    set_control(page, "gqa-groups", 8)
    assert [k for k in read(page)["kinds"] if k.startswith("gqa")] == ["gqa8"]
    set_control(page, "gqa-groups", ",,,")
    assert "GQA groups must be" in read(page)["error"]
    set_control(page, "gqa-groups", "16,32")
    want = cost.cache_economics(MLAConfig.preset("deepseek-v3"), 4096, "bf16", gqa_groups=(16,))
    assert (
        int(read(page)["rows"]["gqa16"]["bytes-per-sequence"]["value"]) == want["bytes_per_sequence"]["gqa16"]
    )
    choose_model(page, "glm-5")
    glm5 = MLAConfig.preset("glm-5")  # DSA: the latent and its indexer key, as `mlakit cache` says
    want = (576 + glm5.index_head_dim) / 448
    assert float(read(page)["gqa_equivalent"]) == pytest.approx(want)
    assert cost.mla_equivalent_gqa_groups(glm5) == pytest.approx(want)


@pytest.mark.browser
def test_moving_the_controls_updates_box_and_chart(page):
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    set_control(page, "machine", "none")
    set_control(page, "counting", "independent")
    set_control(page, "context", 4096)
    before = read(page)
    Select(page.find_element("id", "model")).select_by_value("glm-4.7-flash")
    glm = read(page)
    assert_tokens(
        "glm-4.7-flash",
        glm["exact"],
        glm["exact_text"],
        cost.crossover(MLAConfig.preset("glm-4.7-flash"), 4096).exact,
    )
    assert glm["limit_text"] == "398.2 tokens"
    assert glm["materialize_d"] != before["materialize_d"] and glm["marker_x"] != before["marker_x"]

    slider = page.find_element("id", "context-slider")
    for _ in range(50):
        slider.send_keys(Keys.ARROW_RIGHT)  # 50 steps of 0.01 in log2: context × 2^0.5
    moved = read(page)
    context = int(moved["context"])
    assert context == round(2 ** (12 + 0.5))
    assert_tokens(
        "slider",
        moved["exact"],
        moved["exact_text"],
        cost.crossover(MLAConfig.preset("glm-4.7-flash"), context).exact,
    )
    assert moved["absorb_d"] != glm["absorb_d"]

    box = page.find_element("id", "context")
    box.clear()
    box.send_keys("65536")
    typed = read(page)
    assert typed["context"] == "65536"
    assert_tokens(
        "typed",
        typed["exact"],
        typed["exact_text"],
        cost.crossover(MLAConfig.preset("glm-4.7-flash"), 65536).exact,
    )

    page.find_element("id", "custom-kv_lora_rank").send_keys(Keys.BACKSPACE * 3, "1024")
    custom = read(page)
    assert custom["model"] == "custom"
    wide = MLAConfig.preset("glm-4.7-flash").replace(kv_lora_rank=1024, name="custom")
    assert_tokens("custom latent", custom["exact"], custom["exact_text"], cost.crossover(wide, 65536).exact)
    set_control(page, "counting", "causal")


CARDS = ("crossover-exact", "crossover-limit", "crossover-roofline", "gqa-equivalent", "crossover-measured")


def cards(d) -> dict:
    return d.execute_script(
        "return Object.fromEntries(arguments[0].map((id) => [id, [document.getElementById(id).dataset.value,"
        " document.getElementById(id).textContent]]))",
        list(CARDS),
    )


@pytest.mark.browser
def test_bad_input_says_so_clears_the_cards_and_recovers(page):
    good = read(page)
    for control, value, message in (
        ("context", 0, "context must be a whole number of tokens from 1"),
        ("custom-qk_rope_head_dim", 3, "qk_rope_head_dim must be even"),  # a bad width
        ("custom-kv_lora_rank", "5x", 'kv_lora_rank must be an integer >= 1, got "5x"'),
    ):
        before = (
            page.find_element("id", "custom-" + control.removeprefix("custom-")).get_attribute("value")
            if (control.startswith("custom-"))
            else good["context"]
        )
        set_control(page, control, value)
        bad = read(page)
        assert message in bad["error"] and bad["stale"], control
        assert cards(page) == {card: ["invalid", "—"] for card in CARDS}, control  # no old figure stands
        set_control(page, control, before)
        assert read(page)["exact"] == good["exact"] and cards(page)["crossover-exact"][1] != "—"
    set_control(page, "context", 0)
    set_control(page, "context", 1)  # one cached token is a context too
    one = read(page)
    assert one["error"] == "" and not one["stale"]
    assert_tokens(
        "context 1",
        one["exact"],
        one["exact_text"],
        cost.crossover(MLAConfig.preset("deepseek-v3"), 1, "causal").exact,
    )
    set_control(page, "custom-qk_rope_head_dim", 3)
    assert "qk_rope_head_dim must be even" in read(page)["error"]
    set_control(page, "custom-qk_rope_head_dim", 64)
    assert read(page)["error"] == ""


@pytest.mark.browser
def test_bench_overlay_equals_measured_crossover(page):
    rows = cost.validate_results(bench_results())["rows"]
    v3 = MLAConfig.preset("deepseek-v3")
    for context, batch, cached in ((4096, 1, 4096), (700, 1, 1024), (30000, 8, 32768)):
        set_control(page, "bench-batch", batch)
        set_control(page, "context", context)
        s = read(page)
        assert int(s["bench_cached"]) == cached
        want = cost.measured_crossover(rows, cached, batch, "bf16")
        assert want is not None and 1 < want < 16384
        assert math.isclose(float(s["measured"]), want, rel_tol=1e-9), (context, batch)
        assert math.isclose(float(s["predicted"]), cost.crossover(v3, cached, "causal").exact, rel_tol=1e-9)
        assert s["measured_lines"] == 2
    choose_model(page, "kimi-k2")  # measured on deepseek-v3: the overlay steps aside
    s = read(page)
    assert s["measured_lines"] == 0 and s["measured"] == "none"
    assert "deepseek-v3" in page.find_element("id", "bench-note").text


@pytest.mark.browser
def test_page_without_bench_hides_the_panel(driver, tmp_path):
    driver.get("file://" + write_explorer(str(tmp_path / "plain.html")))
    assert not driver.find_element("id", "bench").is_displayed()
    s = read(driver)
    assert (s["context"], s["machine"]) == ("4096", "none")
    assert (
        s["exact_text"]
        == f"{cost.crossover(MLAConfig.preset('deepseek-v3'), 4096, 'causal').exact:.1f} tokens"
    )
    assert page_errors(driver.get_log("browser")) == []


def step_ms(cfg, mode, batch, new, cached, dtype, machine) -> float:
    """What a bench row's step costs under the roofline (mlakit.bench.costs, causal counting)."""
    from mlakit.bench import costs

    row = {"batch": batch, "new": new, "cached": cached}
    macs, nbytes = costs.row_terms(cfg, row, dtype, mode, None)
    return 1e3 * sum(t["time_s"] for t in cost.term_times(macs, nbytes, machine, dtype).values())


@pytest.mark.browser
def test_measured_and_predicted_share_one_time_axis(page):
    machine = cost.MachineProfile(**MEASURED)
    v3 = MLAConfig.preset("deepseek-v3")
    for batch, cached in ((1, 1024), (8, 32768)):
        set_control(page, "bench-batch", batch)
        set_control(page, "context", cached)
        s = read(page)
        want = cost.roofline_crossover(v3, cached, machine, "bf16", "causal")
        assert math.isclose(float(s["roofline"]), want, rel_tol=1e-6)
        rows = cost.validate_results(bench_results())["rows"]
        for new in (1, 64):
            page.execute_script("showReadout(arguments[0])", new)
            got = page.execute_script("return {...document.getElementById('readout').dataset}")
            for mode in ("materialize", "absorb"):
                want_ms = step_ms(v3, mode, batch, new, cached, "bf16", machine)
                assert math.isclose(float(got[mode]), want_ms, rel_tol=1e-9), (mode, batch, cached, new)
        # the measured dots sit on the axis the predicted lines use
        mine = [r for r in rows if (r["batch"], r["cached"]) == (batch, cached) and r["backend"] != "mha"]
        assert len(s["dots"]) == len(mine)
        for _, ms, cy in s["dots"]:
            at = page.execute_script(
                "return document.getElementById('chart').yScale.at(arguments[0])", float(ms)
            )
            assert math.isclose(float(cy), at, rel_tol=1e-9)


@pytest.mark.browser
def test_hover_reads_out_the_point_under_the_mouse(page):
    from selenium.webdriver.common.action_chains import ActionChains

    set_control(page, "machine", "none")
    set_control(page, "counting", "causal")
    set_control(page, "context", 4096)
    chart = page.find_element("id", "chart")
    ActionChains(page).move_to_element(chart).perform()  # the middle of the chart
    got = page.execute_script("return {...document.getElementById('readout').dataset}")
    n = int(got["new"])
    assert 1 < n < 16384
    v3 = MLAConfig.preset("deepseek-v3")
    for mode in ("materialize", "absorb"):
        assert float(got[mode]) == cost.path_macs(v3, mode, n, 4096, "causal")
    assert f"new {n:,}" in page.find_element("id", "readout").text
    page.execute_script("showCrossReadout(700)")
    x = page.execute_script("return {...document.getElementById('xreadout').dataset}")
    assert math.isclose(float(x["value"]), cost.crossover(v3, 700, "causal").exact, rel_tol=1e-12)


@pytest.mark.browser
def test_machine_picker_matches_the_cli(page):
    options = page.execute_script(
        "return [...document.getElementById('machine').options].map((o) => o.value)"
    )
    assert options == ["none", *cost.MACHINES, "measured"]
    v3 = MLAConfig.preset("deepseek-v3")
    for name in cost.MACHINES:
        set_control(page, "machine", name)
        set_control(page, "context", 4096)
        want = cost.roofline_crossover(v3, 4096, name, "bf16", "causal")
        assert math.isclose(float(read(page)["roofline"]), want, rel_tol=1e-6), name


@pytest.mark.browser
def test_the_url_keeps_the_view(driver, page_url):
    driver.get(page_url)
    set_control(driver, "model", "glm-5")
    set_control(driver, "context", 777)
    set_control(driver, "counting", "independent")
    set_control(driver, "machine", "h200")
    set_control(driver, "gqa-groups", "2,4")
    set_control(driver, "dsa-new", 9)
    link = driver.current_url
    assert "context=777" in link and "machine=h200" in link and "dsa-new=9" in link
    driver.get("about:blank")
    driver.get(link)
    s = read(driver)
    assert (s["model"], s["context"], s["machine"]) == ("glm-5", "777", "h200")
    assert driver.find_element("id", "counting").get_attribute("value") == "independent"
    assert "gqa2" in s["rows"]
    assert driver.find_element("id", "dsa-new").get_attribute("value") == "9"
    check_dsa_terms(read_dsa(driver), MLAConfig.preset("glm-5"), 777, "independent", "bf16", 9)
    check_sparse_headline(s, MLAConfig.preset("glm-5"), 777, "independent", "from link")
    driver.get(page_url)  # the other tests start from the plain page


# --- the DSA panel (sparse models): equal to mlakit.cost.sparse

DSA_MODELS = ("deepseek-v3.2", "glm-5")
# below k, k and k+1, either side of both models' break-even (2,177.0), inside and past the bytes
# break-even band (2,313-2,633), the usual 32K and 128K, and the top of the range
DSA_CONTEXTS = (1, 1000, 2048, 2049, 2176, 2178, 2400, 2700, 4096, 32768, 131072, 1 << 20)

READ_DSA = """
const el = (id) => document.getElementById(id);
const v = (id) => el(id).dataset.value;
const decode = {};
for (const tr of document.querySelectorAll('#dsa-decode-body tr')) {
  decode[tr.dataset.key] = {core: tr.querySelector('.core').dataset.value,
                            all_terms: tr.querySelector('.all-terms').dataset.value};
}
const terms = [...document.querySelectorAll('#dsa-terms-body tr')].map((tr) => [tr.dataset.path,
  tr.dataset.term, tr.querySelector('.macs').dataset.value, tr.querySelector('.bytes').dataset.value]);
const note = el('dsa-terms-note').dataset;
return {
  shown: !el('dsa').hidden, error: el('error').textContent,
  ratio: v('dsa-ratio'), ratio_text: el('dsa-ratio').textContent,
  share: v('dsa-share'), share_text: el('dsa-share').textContent,
  breakeven: v('dsa-breakeven'), breakeven_text: el('dsa-breakeven').textContent,
  breakeven_projections: v('dsa-breakeven-projections'),
  breakeven_bytes: v('dsa-breakeven-bytes'), breakeven_bytes_fp8: v('dsa-breakeven-bytes-fp8'),
  crossover: [el('dsa-crossover').dataset.lower, el('dsa-crossover').dataset.upper],
  crossover_text: el('dsa-crossover').textContent,
  crossover_independent: v('dsa-crossover-independent'),
  cache_token: v('dsa-cache-token'), cache_sequence: v('dsa-cache-sequence'),
  cache_token_text: el('dsa-cache-token').textContent, cache_layer: el('dsa-cache-layer').textContent,
  marker: el('dsa-breakeven-marker') ? el('dsa-breakeven-marker').dataset.context : null,
  decode: decode, terms: terms, dense: note.dense, fewer: note.fewer, auto: note.auto,
};
"""


def read_dsa(d) -> dict:
    return d.execute_script(READ_DSA)


def assert_figure(name: str, got: str, want, rel: float = 1e-12) -> None:
    """A figure the page shows against Python's; the page shows none where Python's is not a positive
    number (an indexer that costs more per key than attention never pays off)."""
    if want is None or want <= 0:
        assert got == "none", f"{name}: got {got!r}, want none (Python: {want!r})"
        return
    assert got != "none" and math.isclose(float(got), want, rel_tol=rel), (
        f"{name}: got {got!r}, want {want!r}"
    )


def check_dsa_panel(s: dict, cfg: MLAConfig, context: int, counting: str, dtype: str, new: int = 1) -> None:
    where = f"{cfg.name} at {context} ({counting}, {dtype}, new {new})"
    assert s["shown"] and s["error"] == "", where
    summary = cost.dsa_decode_summary(cfg, context)
    for part in ("core", "all_terms"):
        for key in ("dense", "sparse", "ratio", "indexer_share"):
            assert_figure(f"decode {part} {key}, {where}", s["decode"][key][part], summary[part][key])
    assert_figure(f"ratio box, {where}", s["ratio"], summary["core"]["ratio"])
    assert_figure(f"share box, {where}", s["share"], summary["core"]["indexer_share"])
    assert s["ratio_text"] == f"{summary['core']['ratio']:.2f}×", where
    assert int(s["decode"]["index"]["core"]) == cost.sparse.sparse_core_macs(cfg, context)["index_scores"], (
        where
    )
    terms = cost.sparse_path_terms(cfg, "sparse-absorb", 1, context)
    index_all = sum(v for k, v in terms.items() if k.startswith("index_"))
    assert int(s["decode"]["index"]["all_terms"]) == index_all, where

    assert_figure(f"break-even, {where}", s["breakeven"], cost.dsa_breakeven(cfg))
    assert_figure(f"marker, {where}", s["marker"], cost.dsa_breakeven(cfg))
    assert_figure(
        f"break-even + projections, {where}", s["breakeven_projections"], cost.dsa_breakeven(cfg, True)
    )
    assert_figure(f"break-even bytes, {where}", s["breakeven_bytes"], cost.dsa_breakeven_bytes(cfg, dtype))
    want_fp8 = cost.dsa_breakeven_bytes(cfg, dtype, "fp8")
    assert_figure(f"break-even bytes, fp8 key, {where}", s["breakeven_bytes_fp8"], want_fp8)

    band = cost.sparse_crossover(cfg, context, counting)
    if band is None:
        assert s["crossover"] == ["none", "none"] and s["crossover_text"] == "never", where
    else:
        assert_figure(f"crossover lower, {where}", s["crossover"][0], band[0], rel=1e-8)
        assert_figure(f"crossover upper, {where}", s["crossover"][1], band[1], rel=1e-8)
    closed = cost.sparse.independent_sparse_crossover(cfg, context) if context > cfg.index_topk else None
    assert_figure(f"closed form, {where}", s["crossover_independent"], closed)

    economics = cost.cache_economics(cfg, context, dtype)["indexer"]
    assert int(s["cache_token"]) == economics["mla_with_indexer_bytes_per_token"], where
    assert int(s["cache_sequence"]) == economics["mla_with_indexer_bytes_per_sequence"], where
    assert s["cache_token_text"] == cost.format_bytes(economics["mla_with_indexer_bytes_per_token"]), where
    assert s["cache_layer"] == f"{economics['mla_with_indexer_bytes_per_token_per_layer']:,}", where
    check_dsa_terms(s, cfg, context, counting, dtype, new)


def check_dsa_terms(s: dict, cfg: MLAConfig, context: int, counting: str, dtype: str, new: int) -> None:
    """The term table: both sparse paths as `mlakit cost` prints them, and dense absorb beside them."""
    where = f"{cfg.name} at {context} ({counting}, {dtype}, new {new})"
    want = cost.sparse_cost(cfg, context, new, dtype, counting)
    macs = cost.absorb_macs(cfg, new, context, counting)
    nbytes = cost.absorb_bytes(cfg, new, context, counting, dtype)
    dense = {name: {"macs": macs[name], "bytes": nbytes[name]} for name in macs}
    paths = {**want["terms"], "absorb": dense}
    totals = {**want["totals"], "absorb": {"macs": sum(macs.values()), "bytes": sum(nbytes.values())}}
    rows = [
        (path, term, t["macs"], t["bytes"])
        for path, terms in paths.items()
        for term, t in [*terms.items(), ("total", totals[path])]
    ]
    got = [(path, term, int(m), int(b)) for path, term, m, b in s["terms"]]
    assert got == rows, where
    flags = (str(want["dense"]).lower(), want["fewer_macs"], want["auto_picks"])
    assert (s["dense"], s["fewer"], s["auto"]) == flags, where


@pytest.mark.browser
def test_dsa_panel_equals_sparse_cost_over_a_grid(page):
    set_control(page, "dtype", "bf16")
    for name in DSA_MODELS:
        choose_model(page, name)
        cfg = MLAConfig.preset(name)
        for context in DSA_CONTEXTS:
            set_control(page, "context", context)
            for counting in cost.MODELS:
                set_control(page, "counting", counting)
                check_dsa_panel(read_dsa(page), cfg, context, counting, "bf16")
    set_control(page, "counting", "causal")


@pytest.mark.browser
def test_dsa_terms_over_new_tokens_and_dtypes(page):
    choose_model(page, "deepseek-v3.2")
    cfg = MLAConfig.preset("deepseek-v3.2")
    set_control(page, "counting", "causal")
    for context, new in ((1000, 1), (1000, 1049), (2047, 2), (4096, 700), (4096, 6000), (131072, 16384)):
        set_control(page, "context", context)
        set_control(page, "dsa-new", new)
        for dtype in cost.CACHE_DTYPES:
            set_control(page, "dtype", dtype)
            check_dsa_panel(read_dsa(page), cfg, context, "causal", dtype, new)
    set_control(page, "dsa-new", 1)
    set_control(page, "dtype", "bf16")


@pytest.mark.browser
def test_dsa_headline_figures_at_128k(page):
    """The usual DSA figures, as the model gives them: 13.4x fewer multiply-adds than dense at 128K and the
    indexer ~79% of what remains (context-dependent terms); break-even ~2,180 tokens in multiply-adds."""
    choose_model(page, "deepseek-v3.2")
    set_control(page, "dtype", "bf16")
    set_control(page, "context", 131072)
    s = read_dsa(page)
    want = cost.dsa_decode_summary(MLAConfig.preset("deepseek-v3.2"), 131072)["core"]
    # the quoted ~13.4x and ~79%: 13.35x and 79.1% here (scoring counts H_I(d_I+1) per key; without
    # the weight's +1 it would be 13.43x and 79.0%)
    assert abs(want["ratio"] - 13.4) < 0.06 and abs(want["indexer_share"] - 0.79) < 0.005
    assert s["ratio_text"] == f"{want['ratio']:.2f}×" == "13.35×"
    assert s["share_text"] == f"{want['indexer_share']:.1%}" == "79.1%"
    assert s["breakeven_text"] == "2,177 tokens" and abs(float(s["breakeven"]) - 2180) < 5
    assert round(float(s["breakeven_bytes_fp8"])) == 2313 and round(float(s["breakeven_bytes"])) == 2633


@pytest.mark.browser
def test_dsa_panel_for_custom_widths(page):
    set_control(page, "dtype", "bf16")
    set_control(page, "counting", "causal")
    for name in SPARSE_CUSTOM:
        choose_model(page, name)
        cfg = preset_or_custom(name)
        for context in (3, cfg.index_topk, cfg.index_topk + 1, 40, 5000):
            set_control(page, "context", context)
            check_dsa_panel(read_dsa(page), cfg, context, "causal", "bf16")
    s = read_dsa(page)  # heavy-indexer: scoring a key costs more than attending to it
    assert s["breakeven"] == "none" and s["breakeven_text"] == "never"
    set_control(page, "custom-index_head_dim", 4)  # not wider than the rope dims
    assert "index_head_dim must be > qk_rope_head_dim (4), got 4" in read(page)["error"]
    set_control(page, "custom-index_head_dim", 130)
    set_control(page, "custom-q_lora_rank", 0)
    assert "q_lora_rank is 0" in read(page)["error"]
    set_control(page, "custom-q_lora_rank", 8)
    set_control(page, "dsa-new", 0)
    assert "new tokens (DSA terms) must be" in read(page)["error"]
    set_control(page, "dsa-new", 1)
    set_control(page, "custom-index_topk", 0)  # top-k 0: dense MLA, the panel steps aside
    s = read_dsa(page)
    assert s["error"] == "" and not s["shown"]
    assert not page.find_element("id", "dsa").is_displayed()


@pytest.mark.browser
def test_dsa_panel_hidden_for_dense_models(page):
    set_control(page, "counting", "causal")
    set_control(page, "context", 131072)
    choose_model(page, "glm-5")
    assert page.find_element("id", "dsa").is_displayed()
    for name in [n for n in PRESETS if not MLAConfig.preset(n).is_sparse]:
        choose_model(page, name)
        assert not read_dsa(page)["shown"], name
        assert not page.find_element("id", "dsa").is_displayed(), name
        s = read(page)
        want = cost.crossover(MLAConfig.preset(name), 131072, "causal").exact
        assert_tokens(name, s["exact"], s["exact_text"], want)  # the rest of the page carries on


def test_dsa_figures_are_not_in_the_file():
    html = render_explorer()
    for figure in ("2177", "2,177", "13.35", "79.1", "2633", "2,633", "2313", "11.3 GB"):
        assert figure not in html, figure


def test_ci_installs_chromium():
    with open(os.path.join(os.path.dirname(__file__), "..", ".ci", "run"), encoding="utf-8") as f:
        text = f.read()
    assert "chromium" in text and "chromium-driver" in text


# --- the inputs read what the CLI reads; one sparse answer; "measured" only when measured


CONTEXT_FORMS = [("32K", 32768), ("32k", 32768), ("1M", 1 << 20), ("4_096", 4096), (" 700 ", 700)]
CONTEXT_REFUSED = ["2M", "32KB", "1,000", "3.5K", "", "1e3"]


@pytest.mark.browser
def test_context_reads_the_clis_forms_and_refuses_the_rest(page):
    from mlakit.commands.args import parse_count

    set_control(page, "machine", "none")
    set_control(page, "counting", "causal")
    v3 = MLAConfig.preset("deepseek-v3")
    for typed, want in CONTEXT_FORMS:
        assert parse_count(typed, "context") == want  # what `mlakit crossover --context` reads
        set_control(page, "context", typed)
        s = read(page)
        assert s["error"] == "" and s["rows"]["mla"]["bytes-per-sequence"]["value"] == str(70272 * want)
        assert_tokens(typed, s["exact"], s["exact_text"], cost.crossover(v3, want, "causal").exact)
    for typed in CONTEXT_REFUSED:
        with pytest.raises(ValueError):
            parse_count(typed, "context", 1, 1 << 20)
        set_control(page, "context", typed)
        s = read(page)
        assert f'got "{typed}"' in s["error"] and s["stale"] and s["exact_text"] == "—", typed


@pytest.mark.browser
def test_dsa_model_has_one_answer_on_the_page(page, capsys):
    from mlakit.cli import main

    choose_model(page, "deepseek-v3.2")
    set_control(page, "counting", "causal")
    set_control(page, "dtype", "bf16")
    set_control(page, "context", "128K")
    s, dsa = read(page), read_dsa(page)
    assert s["exact_text"] == dsa["crossover_text"] == "never"  # the headline card and the panel agree
    assert s["dense_text"] == "the dense layer's crossover: 170.6 tokens"
    assert main(["crossover", "--model", "deepseek-v3.2", "--context", "128K", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sparse"]["materialize_cheaper"] is None  # the CLI: never too
    assert s["kinds"][:2] == ["mla+indexer", "mla"]
    row = s["rows"]["mla+indexer"]["bytes-per-sequence"]
    assert row["value"] == dsa["cache_sequence"] and row["text"] == "11.3 GB"  # table = panel
    assert s["rows"]["mla"]["bytes-per-sequence"]["text"] == "9.21 GB"  # the latent alone, labelled


def measured_label(d) -> dict:
    return d.execute_script(
        "return {legend: !document.getElementById('legend-measured').hidden,"
        " xlegend: !document.getElementById('xlegend-measured').hidden,"
        " title: document.getElementById('chart-title').textContent,"
        " note: document.getElementById('chart-note').textContent}"
    )


@pytest.mark.browser
def test_chart_says_measured_only_with_bench_data(driver, page_url, tmp_path):
    driver.get("file://" + write_explorer(str(tmp_path / "plain.html")))
    for machine in ("none", "h100"):
        set_control(driver, "machine", machine)
        m = measured_label(driver)
        assert not m["legend"] and not m["xlegend"], machine
        assert "measured" not in m["title"] and "measured medians" not in m["note"], machine
    assert page_errors(driver.get_log("browser")) == []
    driver.get(page_url)  # bench data for deepseek-v3 on its measured machine
    m = measured_label(driver)
    assert m["legend"] and m["xlegend"] and "measured" in m["title"]
    choose_model(driver, "kimi-k2")  # measured on another model: no measured figure drawn
    m = measured_label(driver)
    assert not m["legend"] and not m["xlegend"] and "measured" not in m["title"]
    driver.get(page_url)


READ_CAPACITY = """
const rows = {};
for (const tr of document.querySelectorAll('#capacity-body tr')) {
  rows[tr.dataset.kind] = {dtype: tr.querySelector('.dtype').textContent,
    per_layer: tr.querySelector('.per-layer').dataset.value,
    per_sequence: tr.querySelector('.per-sequence').dataset.value,
    sequences: tr.querySelector('.sequences').dataset.value};
}
const note = document.getElementById('capacity-arithmetic');
return {rows: rows, kinds: Object.keys(rows), free: note.dataset.free, tokens: note.dataset.tokens,
        note: note.textContent, error: document.getElementById('error').textContent};
"""

CAPACITY_CASES = [  # model, context, memory, tp, cp, weights memory, weights dtype, cache dtype, groups
    ("deepseek-v3", "128K", "141GB", 8, 1, "", "fp8", "bf16", "4,8"),
    ("deepseek-v3", "32K", "80GiB", 8, 2, "", "bf16", "fp32", "4,8"),
    ("deepseek-v3.2", "128K", "141GB", 8, 1, "", "fp8", "fp8", "8"),
    ("glm-5", "100000", "96GB", 16, 3, "1.5TB", "bf16", "int8", "2,4"),
    ("deepseek-v2-lite", "4097", "24GiB", 1, 3, "", "int4", "bf16", "4,8"),
    ("odd", "1000", "1GB", 4, 5, "2MB", "bf16", "bf16", "2,3"),
]


@pytest.mark.browser
@pytest.mark.parametrize(
    "case", CAPACITY_CASES, ids=[f"{c[0]}-{c[1]}-tp{c[3]}-cp{c[4]}" for c in CAPACITY_CASES]
)
def test_capacity_panel_equals_the_cli(page, case):
    from mlakit.commands.args import parse_count
    from mlakit.commands.capacity import parse_bytes

    model, context, memory, tp, cp, weights, wdtype, dtype, groups = case
    choose_model(page, model)
    for control, value in (
        ("context", context),
        ("dtype", dtype),
        ("gqa-groups", groups),
        ("capacity-memory", memory),
        ("capacity-tp", tp),
        ("capacity-cp", cp),
        ("capacity-weights-memory", weights),
        ("capacity-weights-dtype", wdtype),
    ):
        set_control(page, control, value)
    got = page.execute_script(READ_CAPACITY)
    cfg = preset_or_custom(model)
    from mlakit.cost.capacity import capacity

    want = capacity(
        cfg,
        parse_count(context, "context"),
        parse_bytes(memory, "memory"),
        dtype,
        tp,
        cp,
        parse_bytes(weights, "weights-memory") if weights else None,
        wdtype,
        tuple(int(g) for g in groups.split(",")),
    )
    assert got["error"] == "" and int(got["free"]) == want["free_bytes_per_rank"]
    assert int(got["tokens"]) == want["tokens_per_rank"] and got["kinds"] == list(want["caches"])
    for kind, r in want["caches"].items():
        g = got["rows"][kind]
        assert g["dtype"] == r["dtype"], kind
        assert int(g["per_layer"]) == r["bytes_per_token_per_layer_per_rank"], kind
        assert int(g["per_sequence"]) == r["bytes_per_sequence_per_rank"], kind
        assert int(g["sequences"]) == r["sequences_per_rank"], kind


@pytest.mark.browser
def test_capacity_panel_refuses_visibly(page):
    choose_model(page, "deepseek-v3")
    for control, value, message in (
        ("capacity-memory", "80XB", "memory per rank takes a size"),
        ("capacity-tp", "0", "tensor-parallel ranks"),
        ("capacity-tp", "256", "tp=256 exceeds the 128 heads"),
        ("capacity-cp", "two", "context-parallel ranks"),
        ("capacity-weights-memory", "lots", "weights memory takes a size"),
    ):
        good = page.find_element("id", control).get_attribute("value")
        set_control(page, control, value)
        s = page.execute_script(READ_CAPACITY)
        assert message in s["error"] and read(page)["exact_text"] == "—", control
        set_control(page, control, good)
    choose_model(page, "odd")  # custom widths: no published parameter count
    s = page.execute_script(READ_CAPACITY)
    assert (
        s["error"] == "" and s["free"] == "none" and "give the weights' memory" in s["note"] and not s["rows"]
    )


@pytest.mark.parametrize(
    "browser,driver_path,want",
    [
        (None, None, "chromium and chromedriver not found on PATH (apt-get install chromium chromium-driver"),
        ("/usr/bin/chromium", None, "chromedriver not found on PATH (apt-get install chromium-driver;"),
        (None, "/usr/bin/chromedriver", "chromium not found on PATH (apt-get install chromium;"),
        ("/usr/bin/chromium", "/usr/bin/chromedriver", None),
    ],
    ids=["neither", "no-driver", "no-browser", "both"],
)
def test_browser_skip_names_what_is_missing(browser, driver_path, want):
    got = missing_browser_parts(browser, driver_path)
    assert got == want if want is None else got.startswith(want)
