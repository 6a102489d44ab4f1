"use strict";
// Controls, the charts (inline SVG), the boxes, the cache panel, the bench overlay, the URL.

const $ = (id) => document.getElementById(id);
const SVGNS = "http://www.w3.org/2000/svg";
const CHART = { width: 720, height: 400, left: 70, right: 20, top: 20, bottom: 50 };
const XCHART = { width: 720, height: 320, left: 70, right: 20, top: 20, bottom: 50 };
const NEW_MAX = INPUTS.new_range[1];
const INDEX_FIELDS = ["index_n_heads", "index_head_dim", "index_topk"]; // 0: dense MLA (no indexer)
const ALL_FIELDS = [...FIELDS, "hidden_size", "q_lora_rank", ...INDEX_FIELDS];
const VIEW_KEYS = ["model", "context", "counting", "machine", "dtype", "gqa-groups", "bench-batch", "bench-dtype", "dsa-new", ...CAPACITY_INPUTS];
const STALE = ["chart", "xchart", "cache-table", "dsa-decode", "dsa-terms", "dsa-chart", "capacity-table"];
let VIEW = null; // the last valid state, for the hover readouts

function svg(tag, attrs, parent) {
  const el = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}

function tokens(x) {
  return x === null ? "none" : x.toFixed(1) + " tokens";
}

function setValue(id, x, text) {
  $(id).dataset.value = x === null ? "none" : String(x);
  $(id).textContent = text === undefined ? tokens(x) : text;
}

function tickLabel(v) {
  if (v >= 1 << 20 && v % (1 << 20) === 0) return v / (1 << 20) + "M";
  if (v >= 1024 && v % 1024 === 0) return v / 1024 + "K";
  return String(v);
}

function parseGroups(text) {
  const parts = String(text).split(",").map((p) => p.trim());
  if (!parts.length || parts.some((p) => !/^[0-9]+$/.test(p) || Number(p) < 1)) return null;
  return [...new Set(parts.map(Number))];
}

function readState() {
  const errors = [];
  const name = $("model").value;
  const w = {};
  for (const f of ALL_FIELDS) {
    const text = $("custom-" + f).value.trim();
    w[f] = /^[0-9]{1,15}$/.test(text) ? Number(text) : NaN;
    const low = f === "q_lora_rank" || INDEX_FIELDS.includes(f) ? 0 : 1;
    if (!Number.isInteger(w[f]) || w[f] < low) errors.push(`${f} must be an integer >= ${low}, got "${$("custom-" + f).value}"`);
  }
  if (w.q_lora_rank === 0) w.q_lora_rank = null;
  if (w.qk_rope_head_dim % 2) errors.push(`qk_rope_head_dim must be even, got ${w.qk_rope_head_dim}`);
  errors.push(...indexerErrors(w));
  const [lo, hi] = INPUTS.context_range;
  const context = parseCount($("context").value, lo, hi); // as the CLI reads --context: 32K = 32,768
  if (context === null) {
    errors.push(`context must be a whole number of tokens from ${groupDigits(lo)} to ${groupDigits(hi)} (4K = 4,096, 1M = 1,048,576), got "${$("context").value}"`);
  }
  const groups = parseGroups($("gqa-groups").value);
  if (groups === null) errors.push(`GQA groups must be comma-separated positive integers, got "${$("gqa-groups").value}"`);
  const machine = $("machine").value === "none" ? null : INPUTS.machines[$("machine").value];
  const newTokens = parseCount($("dsa-new").value, 1, NEW_MAX);
  if (isSparse(w) && newTokens === null) {
    errors.push(`new tokens (DSA terms) must be a whole number from 1 to ${groupDigits(NEW_MAX)}, got "${$("dsa-new").value}"`);
  }
  const cap = readCapacity(w);
  errors.push(...cap.errors);
  const state = { name, w, context, groups, counting: $("counting").value, dtype: $("dtype").value, machine, newTokens, capacity: cap.inputs };
  return { state, errors };
}

// MLAConfig's indexer checks; index_topk 0 stands for none (dense MLA)
function indexerErrors(w) {
  if (w.index_topk === 0) {
    for (const f of INDEX_FIELDS) w[f] = null;
    return [];
  }
  const errors = [];
  for (const f of INDEX_FIELDS.slice(0, 2)) if (w[f] === 0) errors.push(`${f} must be >= 1 when index_topk is set, got 0`);
  if (w.q_lora_rank === null) errors.push("index_topk is set but q_lora_rank is 0 (none): indexer queries read the query latent");
  if (w.index_head_dim <= w.qk_rope_head_dim) errors.push(`index_head_dim must be > qk_rope_head_dim (${w.qk_rope_head_dim}), got ${w.index_head_dim}`);
  return errors;
}

function update() {
  const { state, errors } = readState();
  $("error").textContent = errors.join("; ");
  for (const id of STALE) $(id).classList.toggle("stale", errors.length > 0);
  if (errors.length) {
    clearCards();
    return;
  }
  $("counting-label").textContent = state.counting;
  const exact = crossover(state.w, state.context, state.counting);
  setValue("crossover-limit", asymptotic(state.w));
  $("machine-label").textContent = state.machine ? state.machine.name : "— (pick a machine)";
  const bench = benchView(state);
  state.timeDtype = bench ? bench.dtype : state.dtype;
  const roof = state.machine ? rooflineCrossover(state.w, state.context, state.machine, state.timeDtype, state.counting) : null;
  if (state.machine) setValue("crossover-roofline", roof);
  else setValue("crossover-roofline", null, "—");
  drawCache(state);
  drawChart(state, exact, roof, bench);
  drawCrossoverChart(state, bench);
  drawDsa(state, state.newTokens);
  drawHeadline(state, exact);
  drawCapacity(state);
  VIEW = { state, bench };
  saveView();
}

// a figure of the last good input must not stand beside an error: every card says "—" until it is fixed
function clearCards() {
  for (const el of document.querySelectorAll(".box .v[id], .box .v [id], .box .s [id], #crossover-dense")) {
    el.dataset.value = "invalid";
    delete el.dataset.lower;
    delete el.dataset.upper;
    el.textContent = "—";
  }
  VIEW = null;
}

// ---- the chart: both paths against new tokens, log-log; multiply-adds, or time on a machine

function yValue(state, bench, mode, n) {
  if (!state.machine) return pathMacs(state.w, mode, n, state.context, state.counting);
  const batch = bench ? bench.batch : 1;
  return 1e3 * stepSeconds(state.w, mode, batch, n, state.context, state.counting, state.timeDtype, state.machine);
}

function drawChart(state, exact, roof, bench) {
  const chart = $("chart");
  chart.replaceChildren();
  const ns = [];
  for (let k = 0; k <= 140; k++) ns.push(Math.pow(2, (k * Math.log2(NEW_MAX)) / 140));
  const lines = {};
  for (const mode of PATHS) lines[mode] = ns.map((n) => [n, yValue(state, bench, mode, n)]);
  const measured = bench && state.machine ? measuredLines(bench) : {};
  const all = [...PATHS.flatMap((m) => lines[m].map((p) => p[1])), ...Object.values(measured).flatMap((l) => l.map((p) => p[1]))];
  const y = logScale(Math.min(...all), Math.max(...all), CHART.height - CHART.bottom, CHART.top);
  const x = logScale(1, NEW_MAX, CHART.left, CHART.width - CHART.right, true);
  const batch = bench ? bench.batch : 1;
  const label = state.machine ? `ms per layer step on ${state.machine.name} (batch ${batch})` : "multiply-adds per layer (core)";
  const shown = Boolean(bench && state.machine); // "measured" only where measured data is drawn
  $("legend-measured").hidden = !shown;
  $("chart-title").textContent = state.machine
    ? `Predicted (roofline)${shown ? " and measured" : ""} time against new tokens`
    : "Multiply-adds of both paths against new tokens";
  $("chart-note").textContent = state.machine
    ? `Lines: roofline time of a whole layer step (projections included), ${state.timeDtype}, ${state.counting} counting, on ${state.machine.name}` +
      (shown ? "; dots: measured medians. Same axis." : "; no measured times for this model (mlakit bench --explore adds them).")
    : "Attention core only: the shared projections (q, kv down, o_proj) are the same for both paths." + (INPUTS.bench ? " Pick a machine to compare with measured times." : "");
  drawAxes(chart, x, y, CHART, label, "new tokens (1 = decode)");
  for (const mode of PATHS) svg("path", { id: "line-" + mode, class: "line " + mode, d: pathD(lines[mode], x, y) }, chart);
  const marker = svg("g", { id: "crossover-marker", "data-new": exact === null ? "none" : String(exact) }, chart);
  const at = state.machine ? roof : exact;
  if (at !== null && at >= 1 && at <= NEW_MAX) {
    svg("line", { x1: x.at(at), x2: x.at(at), y1: CHART.top, y2: CHART.height - CHART.bottom, class: "marker" }, marker);
    const text = (state.machine ? "roofline " : "crossover ") + at.toFixed(1);
    svg("text", { x: x.at(at) + 4, y: CHART.top + 12, class: "marker-label" }, marker).textContent = text;
  } else {
    marker.setAttribute("visibility", "hidden");
  }
  if (bench && state.machine) drawBench(chart, x, y, bench, measured);
  svg("line", { id: "hover-line", class: "hover-line", x1: 0, x2: 0, y1: CHART.top, y2: CHART.height - CHART.bottom, visibility: "hidden" }, chart);
  chart.xScale = x;
  chart.yScale = y;
}

function logScale(lo, hi, p0, p1, exactEnds) {
  const a = exactEnds ? Math.log10(lo) : Math.floor(Math.log10(lo));
  const b = exactEnds ? Math.log10(hi) : Math.max(Math.ceil(Math.log10(hi)), a + 1);
  return { lo: a, hi: b, p0, p1, at: (v) => p0 + ((Math.log10(v) - a) / (b - a)) * (p1 - p0), inv: (p) => 10 ** (a + ((p - p0) / (p1 - p0)) * (b - a)) };
}

function pathD(points, x, y) {
  return points.map(([n, v], i) => (i ? "L" : "M") + x.at(n).toFixed(2) + "," + y.at(v).toFixed(2)).join(" ");
}

function drawAxes(chart, x, y, box, label, xlabel) {
  const bottom = box.height - box.bottom;
  const lo = 10 ** x.lo, hi = 10 ** x.hi;
  for (let e = 0; 4 ** e <= hi; e++) {
    const v = 4 ** e;
    if (v < lo) continue;
    const px = x.at(v);
    svg("line", { x1: px, x2: px, y1: box.top, y2: bottom, class: "grid" }, chart);
    svg("text", { x: px, y: bottom + 18, class: "tick", "text-anchor": "middle" }, chart).textContent = tickLabel(v);
  }
  svg("text", { x: (box.left + box.width - box.right) / 2, y: box.height - 8, class: "axis-label", "text-anchor": "middle" }, chart).textContent = xlabel;
  for (let e = Math.ceil(y.lo); e <= Math.floor(y.hi); e++) {
    const py = y.at(10 ** e);
    svg("line", { x1: box.left, x2: box.width - box.right, y1: py, y2: py, class: "grid" }, chart);
    svg("text", { x: box.left - 6, y: py + 4, class: "tick", "text-anchor": "end" }, chart).textContent = yTick(e);
  }
  svg("text", { x: 14, y: box.height / 2, class: "axis-label", transform: `rotate(-90 14 ${box.height / 2})`, "text-anchor": "middle" }, chart).textContent = label;
}

function yTick(e) {
  if (e >= 0 && e <= 3) return String(10 ** e);
  if (e < 0 && e >= -3) return (10 ** e).toFixed(-e);
  return "1e" + e;
}

// ---- the second chart: the crossover against cached tokens

function drawCrossoverChart(state, bench) {
  const chart = $("xchart");
  chart.replaceChildren();
  const [lo, hi] = INPUTS.context_range;
  const cs = [];
  for (let k = 0; k <= 80; k++) cs.push(Math.round(2 ** (Math.log2(lo) + (k * (Math.log2(hi) - Math.log2(lo))) / 80)));
  const other = state.counting === "causal" ? "independent" : "causal";
  const series = { main: [], other: [], roof: [] };
  for (const c of cs) {
    const a = crossover(state.w, c, state.counting), b = crossover(state.w, c, other);
    if (a !== null && a > 0) series.main.push([c, a]);
    if (b !== null && b > 0) series.other.push([c, b]);
    if (state.machine) {
      const r = rooflineCrossover(state.w, c, state.machine, state.timeDtype, state.counting);
      if (r !== null && r > 0) series.roof.push([c, r]);
    }
  }
  const points = bench ? measuredPoints(bench) : [];
  $("xlegend-measured").hidden = points.length === 0;
  const ys = [...series.main, ...series.other, ...series.roof, ...points].map((p) => p[1]);
  if (!ys.length) ys.push(1, 10);
  const x = logScale(lo, hi, XCHART.left, XCHART.width - XCHART.right, true);
  const y = logScale(Math.min(...ys), Math.max(...ys), XCHART.height - XCHART.bottom, XCHART.top);
  drawAxes(chart, x, y, XCHART, "crossover, new tokens", "cached tokens");
  const cls = { main: "line main", other: "line other", roof: "line roof" };
  for (const [k, pts] of Object.entries(series)) {
    if (pts.length) svg("path", { id: "xline-" + k, class: cls[k], d: pathD(pts, x, y) }, chart);
  }
  for (const [c, m] of points) svg("circle", { class: "dot cross measured-cross", cx: x.at(Math.max(c, lo)), cy: y.at(m), r: 4, "data-context": c, "data-new": m }, chart);
  svg("line", { class: "context-line", x1: x.at(state.context), x2: x.at(state.context), y1: XCHART.top, y2: XCHART.height - XCHART.bottom }, chart);
  svg("line", { id: "xhover-line", class: "hover-line", x1: 0, x2: 0, y1: XCHART.top, y2: XCHART.height - XCHART.bottom, visibility: "hidden" }, chart);
  chart.xScale = x;
}

function measuredPoints(bench) {
  const cached = [...new Set(bench.rows.filter((r) => r.batch === bench.batch && r.dtype === bench.dtype).map((r) => r.cached))];
  return cached
    .map((c) => [c, measuredCrossover(bench.rows, c, bench.batch, bench.dtype)])
    .filter((p) => p[1] !== null && p[1] > 0);
}

// ---- hover readouts

function chartX(chart, event) {
  const box = chart.getBoundingClientRect();
  return ((event.clientX - box.left) / box.width) * chart.viewBox.baseVal.width;
}

function onHover(event) {
  const chart = $("chart");
  if (!VIEW || !chart.xScale) return;
  const px = chartX(chart, event);
  if (px < CHART.left || px > CHART.width - CHART.right) return;
  showReadout(Math.max(1, Math.round(chart.xScale.inv(px))));
}

function showReadout(n) {
  const { state, bench } = VIEW;
  const chart = $("chart");
  const line = $("hover-line");
  line.setAttribute("x1", chart.xScale.at(n));
  line.setAttribute("x2", chart.xScale.at(n));
  line.setAttribute("visibility", "visible");
  const parts = [`new ${groupDigits(n)}`];
  const out = $("readout");
  out.dataset.new = String(n);
  for (const mode of PATHS) {
    const v = yValue(state, bench, mode, n);
    out.dataset[mode] = String(v);
    parts.push(`${mode} ${state.machine ? formatSeconds(v / 1e3) : v.toExponential(3) + " MACs"}`);
  }
  if (bench && state.machine) {
    for (const mode of PATHS) {
      const hit = series(bench.rows, "mlakit-" + mode, bench.cached, bench.batch, bench.dtype).find((p) => p[0] === n);
      if (hit) parts.push(`measured ${mode} ${formatSeconds(hit[1] / 1e3)}`);
    }
  }
  out.textContent = parts.join(" · ");
}

function onCrossHover(event) {
  const chart = $("xchart");
  if (!VIEW || !chart.xScale) return;
  const px = chartX(chart, event);
  if (px < XCHART.left || px > XCHART.width - XCHART.right) return;
  showCrossReadout(Math.max(1, Math.round(chart.xScale.inv(px))));
}

function showCrossReadout(c) {
  const { state } = VIEW;
  const chart = $("xchart");
  $("xhover-line").setAttribute("x1", chart.xScale.at(c));
  $("xhover-line").setAttribute("x2", chart.xScale.at(c));
  $("xhover-line").setAttribute("visibility", "visible");
  const x = crossover(state.w, c, state.counting);
  const out = $("xreadout");
  out.dataset.context = String(c);
  out.dataset.value = x === null ? "none" : String(x);
  const parts = [`cached ${groupDigits(c)}: crossover ${tokens(x)} (${state.counting})`];
  if (state.machine) parts.push(`roofline on ${state.machine.name} ${tokens(rooflineCrossover(state.w, c, state.machine, state.timeDtype, state.counting))}`);
  out.textContent = parts.join(" · ");
}

// ---- the cache panel

function drawCache(state) {
  const body = $("cache-body");
  body.replaceChildren();
  const { rows, lays } = cacheKinds(state.w, state.groups, state.dtype); // exactly the box's groups
  for (const [kind, values, perLayer] of rows) {
    const perToken = perLayer * state.w.num_layers;
    const perSeq = perToken * state.context;
    const tr = document.createElement("tr");
    tr.dataset.kind = kind;
    const cells = [
      ["kind", kind, kind],
      ["values", values, groupDigits(values)],
      ["bytes-per-token-per-layer", perLayer, groupDigits(perLayer) + " B"],
      ["bytes-per-token", perToken, formatBytes(perToken)],
      ["bytes-per-sequence", perSeq, formatBytes(perSeq)],
    ];
    for (const [cls, value, text] of cells) {
      const td = document.createElement("td");
      td.className = cls;
      td.dataset.value = String(value);
      td.textContent = text;
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
  const missing = state.groups.filter((g) => !("gqa" + g in lays));
  $("gqa-note").textContent = missing.length
    ? `GQA with ${missing.join(", ")} groups is not defined for ${state.w.num_heads} heads (1 < g < heads, g divides heads).`
    : "";
  // a DSA model caches its indexer key beside the latent: its equivalence counts the mla+indexer row
  const indexKey = isSparse(state.w) ? state.w.index_head_dim : 0;
  const equiv = (layoutValues(lays.mla) + indexKey) / (state.w.qk_nope_head_dim + state.w.v_head_dim);
  setValue("gqa-equivalent", equiv, equiv.toFixed(2));
  $("sequence-label").textContent = groupDigits(state.context);
}

// ---- bench results: measured times of both paths beside the prediction

function benchView(state) {
  const bench = INPUTS.bench;
  if (!bench) return null;
  const rows = bench.rows.filter((r) => r.backend === "mlakit-absorb" || r.backend === "mlakit-materialize");
  if (bench.model && bench.model !== state.name) {
    $("bench-note").textContent = `The measured times are for ${bench.model}; pick it to see them.`;
    clearBench();
    return null;
  }
  $("bench-note").textContent = state.machine ? "" : "Pick a machine (the measured profile) to see the measured times on the chart.";
  fillSelect("bench-batch", [...new Set(rows.map((r) => r.batch))].sort((a, b) => a - b));
  fillSelect("bench-dtype", [...new Set(rows.map((r) => r.dtype))].sort());
  const batch = Number($("bench-batch").value), dtype = $("bench-dtype").value;
  const cachedValues = [...new Set(rows.filter((r) => r.batch === batch && r.dtype === dtype).map((r) => r.cached))];
  if (!cachedValues.length) {
    clearBench();
    return null;
  }
  const dist = (c) => Math.abs(Math.log(Math.max(c, 1)) - Math.log(state.context));
  const cached = cachedValues.sort((a, b) => dist(a) - dist(b) || a - b)[0];
  $("bench-cached").textContent = groupDigits(cached);
  $("bench-cached").dataset.value = String(cached);
  setValue("crossover-measured", measuredCrossover(rows, cached, batch, dtype));
  setValue("crossover-predicted", crossover(state.w, cached, state.counting));
  return { rows, cached, batch, dtype };
}

function clearBench() {
  for (const id of ["crossover-measured", "crossover-predicted"]) setValue(id, null, "—");
  $("bench-cached").textContent = "—";
}

function fillSelect(id, values) {
  const sel = $(id), keep = sel.value;
  if (sel.options.length !== values.length) {
    sel.replaceChildren(...values.map((v) => new Option(String(v), String(v))));
    sel.value = values.map(String).includes(keep) ? keep : String(values[0]);
  }
}

function measuredLines(bench) {
  const lines = {};
  for (const mode of PATHS) lines[mode] = series(bench.rows, "mlakit-" + mode, bench.cached, bench.batch, bench.dtype);
  return lines;
}

function drawBench(chart, x, y, bench, lines) {
  for (const mode of PATHS) {
    if (!lines[mode].length) continue;
    svg("path", { id: "line-measured-" + mode, class: "measured " + mode, d: pathD(lines[mode], x, y) }, chart);
    for (const [n, ms] of lines[mode]) svg("circle", { cx: x.at(n), cy: y.at(ms), r: 3, class: "dot " + mode, "data-new": n, "data-ms": ms }, chart);
  }
  const m = measuredCrossover(bench.rows, bench.cached, bench.batch, bench.dtype);
  if (m !== null && m >= 1 && m <= NEW_MAX) {
    svg("line", { id: "measured-marker", x1: x.at(m), x2: x.at(m), y1: CHART.top, y2: CHART.height - CHART.bottom, class: "marker measured-marker" }, chart);
    svg("text", { x: x.at(m) + 4, y: CHART.top + 28, class: "marker-label measured-label" }, chart).textContent = "measured " + m.toFixed(1);
  }
}

// ---- the view in the URL: #model=...&context=...; a link reproduces it

function saveView() {
  const p = new URLSearchParams();
  for (const k of VIEW_KEYS) if ($(k).value !== "") p.set(k, $(k).value);
  if ($("model").value === "custom") for (const f of ALL_FIELDS) p.set(f, $("custom-" + f).value);
  const hash = "#" + p.toString();
  if (location.hash !== hash) history.replaceState(null, "", hash);
}

function loadView() {
  const p = new URLSearchParams(location.hash.slice(1));
  if (p.has("model") && (p.get("model") in INPUTS.presets || p.get("model") === "custom")) {
    $("model").value = p.get("model");
    if (p.get("model") !== "custom") fillCustom(INPUTS.presets[p.get("model")]);
  }
  if ($("model").value === "custom") for (const f of ALL_FIELDS) if (p.has(f)) $("custom-" + f).value = p.get(f);
  for (const k of VIEW_KEYS.slice(1)) {
    if (!p.has(k)) continue;
    const el = $(k);
    if (el.tagName === "SELECT" && ![...el.options].some((o) => o.value === p.get(k))) {
      if (k.startsWith("bench-")) el.replaceChildren(new Option(p.get(k), p.get(k)));
      else continue;
    }
    el.value = p.get(k);
  }
}

// ---- controls

function fillCustom(w) {
  for (const f of ALL_FIELDS) $("custom-" + f).value = w[f] === null ? 0 : w[f];
}

function syncSlider() {
  const c = parseCount($("context").value, ...INPUTS.context_range);
  if (c !== null) $("context-slider").value = Math.log2(c);
}

function init() {
  const sel = $("model");
  for (const name of Object.keys(INPUTS.presets)) sel.add(new Option(name, name));
  sel.add(new Option("custom widths", "custom"));
  const msel = $("machine");
  msel.add(new Option("none: count multiply-adds", "none"));
  for (const [key, m] of Object.entries(INPUTS.machines)) msel.add(new Option(key === "measured" ? `measured profile (${m.name})` : m.name, key));
  sel.value = INPUTS.start.model;
  fillCustom(INPUTS.presets[sel.value]);
  $("context").value = INPUTS.start.context;
  $("counting").value = INPUTS.start.counting;
  msel.value = INPUTS.start.machine;
  $("context-slider").min = Math.log2(INPUTS.context_range[0]);
  $("context-slider").max = Math.log2(INPUTS.context_range[1]);
  $("gqa-groups").value = INPUTS.gqa_groups.join(",");
  initCapacity();
  if (INPUTS.bench && INPUTS.bench.dtype) $("dtype").value = INPUTS.bench.dtype;
  $("bench").hidden = !INPUTS.bench;
  loadView();
  syncSlider();
  sel.addEventListener("change", () => {
    if (sel.value !== "custom") fillCustom(INPUTS.presets[sel.value]);
    update();
  });
  for (const f of ALL_FIELDS) {
    $("custom-" + f).addEventListener("input", () => {
      sel.value = "custom";
      update();
    });
  }
  $("context").addEventListener("input", () => {
    syncSlider();
    update();
  });
  $("context-slider").addEventListener("input", () => {
    $("context").value = Math.round(2 ** Number($("context-slider").value));
    update();
  });
  for (const id of ["counting", "machine", "dtype", "gqa-groups", "bench-batch", "bench-dtype", "dsa-new", ...CAPACITY_INPUTS]) {
    $(id).addEventListener("input", update);
    $(id).addEventListener("change", update);
  }
  $("chart").addEventListener("mousemove", onHover);
  $("xchart").addEventListener("mousemove", onCrossHover);
  window.addEventListener("hashchange", () => {
    loadView();
    syncSlider();
    update();
  });
  update();
}

init();
