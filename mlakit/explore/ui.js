"use strict";
// Controls, the chart (inline SVG), the crossover box, the cache panel and the bench overlay.

const $ = (id) => document.getElementById(id);
const SVGNS = "http://www.w3.org/2000/svg";
const CHART = { width: 720, height: 400, left: 70, right: 70, top: 20, bottom: 50 };
const NEW_MAX = INPUTS.new_range[1];

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

function readState() {
  const errors = [];
  const name = $("model").value;
  const w = {};
  for (const f of FIELDS) {
    w[f] = Number($("custom-" + f).value);
    if (!Number.isInteger(w[f]) || w[f] <= 0) errors.push(`${f} must be a positive integer, got "${$("custom-" + f).value}"`);
  }
  if (w.qk_rope_head_dim % 2) errors.push(`qk_rope_head_dim must be even, got ${w.qk_rope_head_dim}`);
  const context = Number($("context").value);
  const [lo, hi] = INPUTS.context_range;
  if (!Number.isInteger(context) || context < lo || context > hi) {
    errors.push(`context must be a whole number of tokens from ${groupDigits(lo)} to ${groupDigits(hi)}, got "${$("context").value}"`);
  }
  const groups = Number($("gqa-groups").value);
  if (!Number.isInteger(groups) || groups <= 0) errors.push(`GQA groups must be a positive integer, got "${$("gqa-groups").value}"`);
  const state = { name, w, context, groups, counting: $("counting").value, dtype: $("dtype").value };
  return { state, errors };
}

function update() {
  const { state, errors } = readState();
  $("error").textContent = errors.join("; ");
  if (errors.length) return;
  const exact = crossover(state.w, state.context, state.counting);
  setValue("crossover-exact", exact);
  setValue("crossover-limit", asymptotic(state.w));
  drawCache(state);
  const bench = benchView(state);
  drawChart(state, exact, bench);
}

// ---- the chart: both totals against new tokens, log-log

function drawChart(state, exact, bench) {
  const chart = $("chart");
  chart.replaceChildren();
  const ns = [];
  for (let k = 0; k <= 140; k++) ns.push(Math.pow(2, (k * Math.log2(NEW_MAX)) / 140));
  const lines = {};
  for (const mode of PATHS) lines[mode] = ns.map((n) => [n, pathMacs(state.w, mode, n, state.context, state.counting)]);
  const all = PATHS.flatMap((m) => lines[m].map((p) => p[1]));
  const y = logScale(Math.min(...all), Math.max(...all), CHART.height - CHART.bottom, CHART.top);
  const x = logScale(1, NEW_MAX, CHART.left, CHART.width - CHART.right, true);
  drawAxes(chart, x, y, "multiply-adds per layer", CHART.left, "end");
  for (const mode of PATHS) {
    svg("path", { id: "line-" + mode, class: "line " + mode, d: pathD(lines[mode], x, y) }, chart);
  }
  const marker = svg("g", { id: "crossover-marker", "data-new": exact === null ? "none" : String(exact) }, chart);
  if (exact !== null && exact >= 1 && exact <= NEW_MAX) {
    svg("line", { x1: x.at(exact), x2: x.at(exact), y1: CHART.top, y2: CHART.height - CHART.bottom, class: "marker" }, marker);
    svg("text", { x: x.at(exact) + 4, y: CHART.top + 12, class: "marker-label" }, marker).textContent = "crossover " + exact.toFixed(1);
  } else {
    marker.setAttribute("visibility", "hidden");
  }
  if (bench) drawBench(chart, x, bench);
}

function logScale(lo, hi, p0, p1, exactEnds) {
  const a = exactEnds ? Math.log10(lo) : Math.floor(Math.log10(lo));
  const b = exactEnds ? Math.log10(hi) : Math.max(Math.ceil(Math.log10(hi)), a + 1);
  return { lo: a, hi: b, at: (v) => p0 + ((Math.log10(v) - a) / (b - a)) * (p1 - p0) };
}

function pathD(points, x, y) {
  return points.map(([n, v], i) => (i ? "L" : "M") + x.at(n).toFixed(2) + "," + y.at(v).toFixed(2)).join(" ");
}

function drawAxes(chart, x, y, label, yPos, anchor) {
  const bottom = CHART.height - CHART.bottom;
  for (let e = 0; e <= Math.floor(x.hi); e++) {
    const px = x.at(10 ** e);
    svg("line", { x1: px, x2: px, y1: CHART.top, y2: bottom, class: "grid" }, chart);
    svg("text", { x: px, y: bottom + 18, class: "tick", "text-anchor": "middle" }, chart).textContent =
      e >= 3 ? 10 ** (e - 3) + "K" : String(10 ** e);
  }
  svg("text", { x: (CHART.left + CHART.width - CHART.right) / 2, y: CHART.height - 8, class: "axis-label", "text-anchor": "middle" }, chart).textContent =
    "new tokens (1 = decode)";
  yAxis(chart, y, label, yPos, anchor, true);
}

function yAxis(chart, y, label, xPos, anchor, grid) {
  const left = anchor === "end";
  for (let e = Math.ceil(y.lo); e <= Math.floor(y.hi); e++) {
    const py = y.at(10 ** e);
    if (grid) svg("line", { x1: CHART.left, x2: CHART.width - CHART.right, y1: py, y2: py, class: "grid" }, chart);
    svg("text", { x: xPos + (left ? -6 : 6), y: py + 4, class: "tick", "text-anchor": anchor }, chart).textContent = "1e" + e;
  }
  const lx = left ? 14 : CHART.width - 10;
  svg("text", { x: lx, y: CHART.height / 2, class: "axis-label", transform: `rotate(-90 ${lx} ${CHART.height / 2})`, "text-anchor": "middle" }, chart).textContent = label;
}

// ---- the cache panel

function drawCache(state) {
  const body = $("cache-body");
  body.replaceChildren();
  const lays = layouts(state.w, [state.groups]);
  for (const [kind, lay] of Object.entries(lays)) {
    const perLayer = layoutBytes(lay, state.dtype);
    const perToken = perLayer * state.w.num_layers;
    const perSeq = perToken * state.context;
    const tr = document.createElement("tr");
    tr.dataset.kind = kind;
    const cells = [
      ["kind", kind, kind],
      ["values", layoutValues(lay), groupDigits(layoutValues(lay))],
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
  const g = state.groups;
  $("gqa-note").textContent = "gqa" + g in lays ? "" : `GQA with ${g} groups is not defined for ${state.w.num_heads} heads (1 < g < heads, g divides heads).`;
  const equiv = layoutValues(lays.mla) / (state.w.qk_nope_head_dim + state.w.v_head_dim);
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
  $("bench-note").textContent = "";
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

function drawBench(chart, x, bench) {
  const lines = {};
  for (const mode of PATHS) lines[mode] = series(bench.rows, "mlakit-" + mode, bench.cached, bench.batch, bench.dtype);
  const all = PATHS.flatMap((m) => lines[m].map((p) => p[1]));
  if (!all.length) return;
  const y = logScale(Math.min(...all), Math.max(...all), CHART.height - CHART.bottom, CHART.top);
  yAxis(chart, y, "measured ms", CHART.width - CHART.right, "start", false);
  for (const mode of PATHS) {
    if (!lines[mode].length) continue;
    svg("path", { id: "line-measured-" + mode, class: "measured " + mode, d: pathD(lines[mode], x, y) }, chart);
    for (const [n, ms] of lines[mode]) svg("circle", { cx: x.at(n), cy: y.at(ms), r: 3, class: "dot " + mode }, chart);
  }
  const m = measuredCrossover(bench.rows, bench.cached, bench.batch, bench.dtype);
  if (m !== null && m >= 1 && m <= NEW_MAX) {
    svg("line", { id: "measured-marker", x1: x.at(m), x2: x.at(m), y1: CHART.top, y2: CHART.height - CHART.bottom, class: "marker measured-marker" }, chart);
    svg("text", { x: x.at(m) + 4, y: CHART.top + 28, class: "marker-label measured-label" }, chart).textContent = "measured " + m.toFixed(1);
  }
}

// ---- controls

function fillCustom(w) {
  for (const f of FIELDS) $("custom-" + f).value = w[f];
}

function syncSlider() {
  const c = Number($("context").value);
  if (c > 0) $("context-slider").value = Math.log2(c);
}

function init() {
  const sel = $("model");
  for (const name of Object.keys(INPUTS.presets)) sel.add(new Option(name, name));
  sel.add(new Option("custom widths", "custom"));
  sel.value = INPUTS.start.model;
  fillCustom(INPUTS.presets[sel.value]);
  $("context").value = INPUTS.start.context;
  $("context").min = INPUTS.context_range[0];
  $("context").max = INPUTS.context_range[1];
  $("context-slider").min = Math.log2(INPUTS.context_range[0]);
  $("context-slider").max = Math.log2(INPUTS.context_range[1]);
  syncSlider();
  $("gqa-groups").value = Math.max(...INPUTS.gqa_groups);
  $("bench").hidden = !INPUTS.bench;
  sel.addEventListener("change", () => {
    if (sel.value !== "custom") fillCustom(INPUTS.presets[sel.value]);
    update();
  });
  for (const f of FIELDS) {
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
  for (const id of ["counting", "dtype", "gqa-groups", "bench-batch", "bench-dtype"]) {
    $(id).addEventListener("input", update);
    $(id).addEventListener("change", update);
  }
  update();
}

init();
