"use strict";
// DeepSeek-V4: mirrors mlakit/cost/v4.py term by term (same order, so the sums round the same way),
// and draws the V4 panel: V3 (MLA), V3.2 (DSA) and V4 per decoded token against context.

const V4_TERMS = ["window", "compressed_dense", "compressed_sparse", "indexer", "compressors", "projections"];
const V4_KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"];
const V4_SHORT = { sliding_attention: "window", compressed_sparse_attention: "CSA", heavily_compressed_attention: "HCA" };

function v4Ratio(v, kind) {
  return { sliding_attention: 0, compressed_sparse_attention: v.csa_ratio, heavily_compressed_attention: v.hca_ratio }[kind];
}

function v4Count(v, kind) {
  return v.layer_types.filter((t) => t === kind).length;
}

function v4EntryBytes(v, dtype) {
  const f = INPUTS.cache_format;
  if (dtype === "fp8" || dtype === "int8") {
    const nope = v.head_dim - v.qk_rope_head_dim;
    return nope + Math.ceil(nope / INPUTS.v4_fp8_tile) * f.scale_bytes + v.qk_rope_head_dim * 2;
  }
  return v.head_dim * f.value_bytes[dtype];
}

function v4IndexBytes(v, dtype) {
  const f = INPUTS.cache_format;
  if (dtype === "fp8" || dtype === "int8") return v.index_head_dim + Math.ceil(v.index_head_dim / 128) * f.scale_bytes;
  return v.index_head_dim * f.value_bytes[dtype];
}

function v4Indexer(v, n, entries, dtype) {
  if (entries <= v.index_topk) return { macs: 0, bytes: 0 };
  const hi = v.index_n_heads, di = v.index_head_dim;
  const macs = n * v.q_lora_rank * hi * di + n * v.hidden_size * hi + n * entries * hi * (di + 1);
  return { macs, bytes: entries * v4IndexBytes(v, dtype) };
}

function v4Compressors(v, kind, n) {
  if (kind === "sliding_attention") return { macs: 0, bytes: 0 };
  const widths = [[v.head_dim, kind === "compressed_sparse_attention" ? 2 : 1]];
  if (kind === "compressed_sparse_attention") widths.push([v.index_head_dim, 2]);
  let macs = 0;
  for (const [w, coff] of widths) macs += n * (2 * v.hidden_size * coff * w + 2 * coff * w);
  return { macs, bytes: 0 };
}

function v4ProjectionMacs(v) {
  const h = v.num_heads, hd = v.head_dim, d = v.hidden_size;
  return d * v.q_lora_rank + v.q_lora_rank * h * hd + d * hd + h * hd * v.o_lora_rank + v.o_groups * v.o_lora_rank * d;
}

function v4LayerTerms(v, kind, c, n, dtype) {
  const h = v.num_heads, hd = v.head_dim, t = c + 1, m = v4Ratio(v, kind);
  const entries = m ? Math.floor(t / m) : 0, win = Math.min(v.sliding_window, t), eb = v4EntryBytes(v, dtype);
  const out = {};
  for (const name of V4_TERMS) out[name] = { macs: 0, bytes: 0 };
  out.window = { macs: n * 2 * h * hd * win, bytes: win * eb };
  if (kind === "heavily_compressed_attention") out.compressed_dense = { macs: n * 2 * h * hd * entries, bytes: entries * eb };
  if (kind === "compressed_sparse_attention") {
    const picked = Math.min(v.index_topk, entries);
    out.compressed_sparse = { macs: n * 2 * h * hd * picked, bytes: picked * eb };
    out.indexer = v4Indexer(v, n, entries, dtype);
  }
  out.compressors = v4Compressors(v, kind, n);
  out.projections = { macs: n * v4ProjectionMacs(v), bytes: 0 };
  return out;
}

function v4ModelMacs(v, c, n, dtype) {
  let total = 0;
  for (const kind of V4_KINDS) {
    const terms = v4LayerTerms(v, kind, c, n, dtype);
    const count = v4Count(v, kind);
    for (const name of V4_TERMS) total += count * terms[name].macs;
  }
  return total;
}

function v4SequenceBytes(v, c, dtype) {
  const eb = v4EntryBytes(v, dtype), window = Math.min(v.sliding_window, c) * eb;
  const per = {
    sliding_attention: window,
    compressed_sparse_attention: window + Math.floor(c / v.csa_ratio) * (eb + v4IndexBytes(v, dtype)),
    heavily_compressed_attention: window + Math.floor(c / v.hca_ratio) * eb,
  };
  return v.layer_types.reduce((s, kind) => s + per[kind], 0);
}

// V3 (dense MLA, absorbed) or V3.2 (DSA): mlakit.cost.v4.mla_cost, from model.js and sparse.js
function v4MlaCost(w, c, n, dtype) {
  let perLayer = sumValues(sharedMacs(w, n));
  let tokenBytes = layoutBytes(layouts(w, []).mla, dtype);
  if (isSparse(w)) {
    perLayer += sumValues(sparseAbsorbMacs(w, n, c, "independent"));
    perLayer += sumValues(indexerMacs(w, n, c, "independent"));
    tokenBytes += indexKeyBytes(w, dtype);
  } else {
    perLayer += sumValues(pathTerms(w, "absorb", n, c, "independent"));
  }
  return { macs: perLayer * w.num_layers, cache_bytes_per_sequence: tokenBytes * w.num_layers * c };
}

function v4Compare(name, c, dtype) {
  const v = INPUTS.v4_presets[name];
  const rows = { [name]: { macs: v4ModelMacs(v, c, 1, dtype), cache_bytes_per_sequence: v4SequenceBytes(v, c, dtype) } };
  for (const other of ["deepseek-v3.2", "deepseek-v3"]) rows[other] = v4MlaCost(INPUTS.presets[other], c, 1, dtype);
  return rows;
}

// --- drawing: reads the page's context and dtype, and its own model select
const V4_CHART = { width: 720, height: 260, left: 88, right: 20, top: 16, bottom: 40 };
const V4_COLORS = { "deepseek-v3": "#d9622b", "deepseek-v3.2": "#2b6cd9" };

function v4Line(svg, points, color) {
  const p = document.createElementNS(SVGNS, "polyline");
  p.setAttribute("points", points.map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join(" "));
  p.setAttribute("fill", "none");
  p.setAttribute("stroke", color);
  p.setAttribute("stroke-width", "2");
  svg.appendChild(p);
}

// "2 kB", "100 GFLOP": a tick value with an SI prefix and the chart's unit
function v4SiLabel(value, unit) {
  const prefixes = ["", "k", "M", "G", "T", "P", "E"];
  const g = Math.max(0, Math.min(prefixes.length - 1, Math.floor(Math.log10(value) / 3 + 1e-9)));
  return `${Number((value / 1000 ** g).toPrecision(3))} ${prefixes[g]}${unit}`;
}

// log-axis ticks between 10^lo and 10^hi: the decades, with 2 and 5 between them when fewer than 3 fit
function v4Ticks(lo, hi) {
  const within = (steps) => {
    const out = [];
    for (let e = Math.floor(lo); e <= Math.ceil(hi); e++)
      for (const m of steps) if (Math.log10(m * 10 ** e) >= lo - 1e-9 && Math.log10(m * 10 ** e) <= hi + 1e-9) out.push(m * 10 ** e);
    return out;
  };
  const decades = within([1]);
  return decades.length >= 3 ? decades : within([1, 2, 5]);
}

function v4YAxis(svg, lo, hi, py, unit, label) {
  const right = V4_CHART.width - V4_CHART.right, H = V4_CHART.height - V4_CHART.top - V4_CHART.bottom;
  for (const v of v4Ticks(lo, hi)) {
    const y = py(v);
    const grid = document.createElementNS(SVGNS, "line");
    for (const [k, val] of [["x1", V4_CHART.left], ["x2", right], ["y1", y], ["y2", y]]) grid.setAttribute(k, val);
    grid.setAttribute("class", "grid");
    svg.appendChild(grid);
    const t = document.createElementNS(SVGNS, "text");
    Object.assign(t.dataset, { value: v, y });
    for (const [k, val] of [["x", V4_CHART.left - 6], ["y", y + 4], ["text-anchor", "end"], ["class", "tick v4-ytick"]]) t.setAttribute(k, val);
    t.textContent = v4SiLabel(v, unit);
    svg.appendChild(t);
  }
  const t = document.createElementNS(SVGNS, "text");
  const mid = V4_CHART.top + H / 2;
  for (const [k, val] of [["x", 12], ["y", mid], ["transform", `rotate(-90 12 ${mid})`], ["text-anchor", "middle"], ["class", "axis-label v4-ylabel"]])
    t.setAttribute(k, val);
  t.textContent = label;
  svg.appendChild(t);
}

function v4Chart(svgId, name, dtype, metric, context, unit, label) {
  const svg = document.getElementById(svgId);
  svg.replaceChildren();
  const xs = [];
  for (let e = 10; e <= 20.0001; e += 0.25) xs.push(Math.round(2 ** e));
  const series = {};
  for (const c of xs) {
    for (const [model, r] of Object.entries(v4Compare(name, c, dtype))) (series[model] ||= []).push(metric(r, c));
  }
  const all = Object.values(series).flat().filter((y) => y > 0);
  const lo = Math.log10(Math.min(...all)), hi = Math.log10(Math.max(...all)) + 1e-9;
  const W = V4_CHART.width - V4_CHART.left - V4_CHART.right, H = V4_CHART.height - V4_CHART.top - V4_CHART.bottom;
  const px = (c) => V4_CHART.left + ((Math.log2(c) - 10) / 10) * W;
  const py = (y) => V4_CHART.top + H - ((Math.log10(y) - lo) / (hi - lo)) * H;
  v4YAxis(svg, lo, hi, py, unit, label);
  for (const [model, ys] of Object.entries(series)) v4Line(svg, xs.map((c, i) => [px(c), py(ys[i])]), V4_COLORS[model] || "#2a9d5c");
  const mark = document.createElementNS(SVGNS, "line");
  const x = px(Math.min(Math.max(context, 1024), 1 << 20));
  for (const [k, val] of [["x1", x], ["x2", x], ["y1", V4_CHART.top], ["y2", V4_CHART.top + H]]) mark.setAttribute(k, val);
  mark.setAttribute("stroke", "#1d2430");
  mark.setAttribute("stroke-dasharray", "4 3");
  svg.appendChild(mark);
  for (const [label, c] of [["1K", 1024], ["32K", 32768], ["1M", 1 << 20]]) {
    const t = document.createElementNS(SVGNS, "text");
    t.setAttribute("x", px(c));
    t.setAttribute("y", V4_CHART.height - 14);
    t.setAttribute("text-anchor", "middle");
    t.textContent = label;
    svg.appendChild(t);
  }
  const xlabel = document.createElementNS(SVGNS, "text");
  for (const [k, val] of [["x", V4_CHART.left + W / 2], ["y", V4_CHART.height - 2], ["text-anchor", "middle"], ["class", "axis-label"]])
    xlabel.setAttribute(k, val);
  xlabel.textContent = "cached tokens (log scale)";
  svg.appendChild(xlabel);
}

function drawV4() {
  const context = Number(document.getElementById("context").value);
  const dtype = document.getElementById("dtype").value;
  const name = document.getElementById("v4-model").value;
  if (!Number.isInteger(context) || context < 1 || !(name in INPUTS.v4_presets)) return;
  const rows = v4Compare(name, context, dtype), base = rows["deepseek-v3.2"];
  const body = document.getElementById("v4-body");
  body.replaceChildren();
  for (const [model, r] of Object.entries(rows)) {
    const tr = document.createElement("tr");
    tr.dataset.model = model;
    tr.dataset.macs = r.macs;
    tr.dataset.cacheBytesPerSequence = r.cache_bytes_per_sequence;
    const cells = [model, (2 * r.macs / 1e9).toFixed(1), (r.macs / base.macs * 100).toFixed(1) + "%",
      formatBytes(r.cache_bytes_per_sequence / context), (r.cache_bytes_per_sequence / base.cache_bytes_per_sequence * 100).toFixed(1) + "%"];
    for (const text of cells) tr.appendChild(Object.assign(document.createElement("td"), { textContent: text }));
    body.appendChild(tr);
  }
  const v = INPUTS.v4_presets[name], terms = document.getElementById("v4-terms-body");
  terms.replaceChildren();
  for (const kind of V4_KINDS.filter((k) => v4Count(v, k))) {
    const t = v4LayerTerms(v, kind, context, 1, dtype);
    for (const term of V4_TERMS) {
      const tr = document.createElement("tr");
      Object.assign(tr.dataset, { kind, term, macs: t[term].macs, bytes: t[term].bytes });
      for (const text of [`${V4_SHORT[kind]} ×${v4Count(v, kind)}`, term, groupDigits(t[term].macs), groupDigits(t[term].bytes)])
        tr.appendChild(Object.assign(document.createElement("td"), { textContent: text }));
      terms.appendChild(tr);
    }
  }
  document.getElementById("v4-context-label").textContent = groupDigits(context);
  v4Chart("v4-flops", name, dtype, (r) => 2 * r.macs, context, "FLOP", "FLOPs / decoded token");
  v4Chart("v4-bytes", name, dtype, (r, c) => r.cache_bytes_per_sequence / c, context, "B", "cache bytes / token");
}

(function initV4() {
  const sel = document.getElementById("v4-model");
  if (!sel) return;
  for (const name of Object.keys(INPUTS.v4_presets)) sel.add(new Option(name, name));
  sel.value = "deepseek-v4-pro" in INPUTS.v4_presets ? "deepseek-v4-pro" : sel.options[0].value;
  for (const id of ["context", "context-slider", "dtype", "v4-model"]) {
    document.getElementById(id).addEventListener("input", () => setTimeout(drawV4, 0));
    document.getElementById(id).addEventListener("change", () => setTimeout(drawV4, 0));
  }
  setTimeout(drawV4, 0);
})();
