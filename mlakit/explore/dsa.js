"use strict";
// The DSA panel: shown for a model with an indexer (index_topk set), hidden for dense MLA.

const DCHART = { width: 720, height: 320, left: 70, right: 20, top: 20, bottom: 50 };
const DSA_PATHS = [...SPARSE_MODES, "absorb"]; // the last: dense absorb, for comparison

function fixed1(x) {
  const [i, f] = x.toFixed(1).split(".");
  return groupDigits(i) + "." + f;
}

function setFigure(id, x, text) {
  $(id).dataset.value = x === null ? "none" : String(x);
  $(id).textContent = x === null ? "never" : text;
}

function drawDsa(state, newTokens) {
  const w = state.w;
  $("dsa").hidden = !isSparse(w);
  if (!isSparse(w)) return;
  $("dsa-context-label").textContent = groupDigits(state.context);
  $("dsa-widths").textContent =
    `index_topk ${groupDigits(w.index_topk)}; indexer ${w.index_n_heads} heads × ${w.index_head_dim}; ` +
    `indexer key ${indexKeyBytes(w, state.dtype)} B per token per layer (${state.dtype}), ${indexKeyBytes(w, "fp8")} B in fp8.`;
  drawDsaDecode(state);
  drawDsaBoxes(state);
  drawDsaTerms(state, newTokens);
  drawDsaCache(state);
  drawDsaChart(state);
}

function drawDsaDecode(state) {
  const s = dsaDecodeSummary(state.w, state.context);
  const body = $("dsa-decode-body");
  body.replaceChildren();
  const rows = [
    ["dense", "dense absorb", (t) => groupDigits(t.dense)],
    ["sparse", "DSA (indexer + attention over min(T, k))", (t) => groupDigits(t.sparse)],
    ["index", "of which the indexer", (t) => groupDigits(t.index)],
    ["ratio", "dense / DSA", (t) => t.ratio.toFixed(2) + "×"],
    ["indexer_share", "indexer share of DSA", (t) => (100 * t.indexer_share).toFixed(1) + "%"],
  ];
  for (const [key, label, text] of rows) {
    const tr = document.createElement("tr");
    tr.dataset.key = key;
    tr.appendChild(cell("label", null, label));
    for (const part of ["core", "all_terms"]) tr.appendChild(cell(part.replace("_", "-"), s[part][key], text(s[part])));
    body.appendChild(tr);
  }
  setFigure("dsa-ratio", s.core.ratio, s.core.ratio.toFixed(2) + "×");
  setFigure("dsa-share", s.core.indexer_share, (100 * s.core.indexer_share).toFixed(1) + "%");
}

function cell(cls, value, text) {
  const td = document.createElement("td");
  td.className = cls;
  if (value !== null) td.dataset.value = String(value);
  td.textContent = text;
  return td;
}

function drawDsaBoxes(state) {
  const w = state.w, k = w.index_topk;
  const macs = dsaBreakeven(w, false), proj = dsaBreakeven(w, true);
  setFigure("dsa-breakeven", macs, macs === null ? "" : groupDigits(Math.round(macs)) + " tokens");
  setFigure("dsa-breakeven-projections", proj, proj === null ? "" : groupDigits(Math.round(proj)));
  const bytes = dsaBreakevenBytes(w, state.dtype), fp8Key = dsaBreakevenBytes(w, state.dtype, "fp8");
  setFigure("dsa-breakeven-bytes", bytes, bytes === null ? "" : groupDigits(Math.round(bytes)) + " tokens");
  setFigure("dsa-breakeven-bytes-fp8", fp8Key, fp8Key === null ? "" : groupDigits(Math.round(fp8Key)));
  $("dsa-bytes-dtype").textContent = state.dtype;
  const band = sparseCrossover(w, state.context, state.counting);
  const box = $("dsa-crossover");
  box.dataset.lower = band === null ? "none" : String(band[0]);
  box.dataset.upper = band === null || band[1] === null ? "none" : String(band[1]);
  box.textContent = band === null ? "never" : `${fixed1(band[0])} ≤ new < ${band[1] === null ? "∞" : fixed1(band[1])}`;
  $("dsa-crossover-counting").textContent = state.counting;
  // the closed form counts k keys per query: it holds past index_topk (at or below it DSA is dense)
  const closed = state.context > k ? independentSparseCrossover(w, state.context) : null;
  setFigure("dsa-crossover-independent", closed, closed === null ? "" : fixed1(closed) + " new tokens");
  if (state.context <= k) $("dsa-crossover-independent").textContent = "— (context ≤ index_topk: DSA is dense)";
}

function drawDsaTerms(state, n) {
  const body = $("dsa-terms-body");
  body.replaceChildren();
  const totals = {};
  for (const mode of DSA_PATHS) {
    const sparse = mode !== "absorb";
    const macs = sparse ? sparsePathTerms(state.w, mode, n, state.context, state.counting) : pathTerms(state.w, mode, n, state.context, state.counting);
    const bytes = sparse ? sparsePathBytes(state.w, mode, n, state.context, state.counting, state.dtype) : pathBytes(state.w, mode, n, state.context, state.counting, state.dtype);
    totals[mode] = { macs: sumValues(macs), bytes: sumValues(bytes) };
    for (const term of [...Object.keys(macs), "total"]) {
      const m = term === "total" ? totals[mode].macs : macs[term], b = term === "total" ? totals[mode].bytes : bytes[term];
      const tr = document.createElement("tr");
      tr.dataset.path = mode;
      tr.dataset.term = term;
      if (term === "total") tr.className = "total";
      for (const [cls, v, text] of [["path", null, sparse ? mode : "dense absorb"], ["term", null, term], ["macs", m, groupDigits(m)], ["bytes", b, groupDigits(b)]]) {
        tr.appendChild(cell(cls, v, text));
      }
      body.appendChild(tr);
    }
  }
  const dense = !needsIndexer(state.w, n, state.context, state.counting);
  const fewer = SPARSE_MODES.reduce((a, b) => (totals[b].macs < totals[a].macs ? b : a));
  const note = $("dsa-terms-note");
  note.dataset.dense = String(dense);
  note.dataset.fewer = fewer;
  note.dataset.auto = chooseSparse(state.w, n, state.context);
  note.textContent =
    (dense ? "Every query sees ≤ index_topk keys: DSA is dense attention here (the indexer only writes its key). " : "") +
    `Fewer multiply-adds: ${fewer}; mode="auto" picks ${note.dataset.auto} (causal counting). ` +
    `Dense absorb / sparse-absorb: ${(totals.absorb.macs / totals["sparse-absorb"].macs).toFixed(2)}× in multiply-adds, ` +
    `${(totals.absorb.bytes / totals["sparse-absorb"].bytes).toFixed(2)}× in bytes.`;
  $("dsa-new-label").textContent = groupDigits(n);
}

function drawDsaCache(state) {
  const c = indexerCache(state.w, state.context, state.dtype);
  setFigure("dsa-cache-token", c.per_token, formatBytes(c.per_token));
  setFigure("dsa-cache-sequence", c.per_sequence, formatBytes(c.per_sequence));
  $("dsa-cache-layer").textContent = groupDigits(c.per_layer);
}

// dense absorb and DSA against cached tokens: the context-dependent multiply-adds of one decode step
function drawDsaChart(state) {
  const chart = $("dsa-chart"), w = state.w, k = w.index_topk;
  chart.replaceChildren();
  const [lo, hi] = INPUTS.context_range;
  const cs = [];
  for (let i = 0; i <= 80; i++) cs.push(2 ** (Math.log2(lo) + (i * (Math.log2(hi) - Math.log2(lo))) / 80));
  const past = [k, ...cs.filter((c) => c > k)].filter((c) => c <= hi);
  const lines = {
    dense: cs.map((c) => [c, denseCoreMacs(w, c)]),
    sparse: past.map((c) => [c, sumValues(sparseCoreMacs(w, c))]),
    index: past.map((c) => [c, sparseCoreMacs(w, c).index_scores]),
  };
  const ys = Object.values(lines).flatMap((l) => l.map((p) => p[1]));
  const x = logScale(lo, hi, DCHART.left, DCHART.width - DCHART.right, true);
  const y = logScale(Math.min(...ys), Math.max(...ys), DCHART.height - DCHART.bottom, DCHART.top);
  drawAxes(chart, x, y, DCHART, "multiply-adds per decode step", "cached tokens");
  for (const [key, pts] of Object.entries(lines)) {
    if (pts.length) svg("path", { id: "dsa-line-" + key, class: "line dsa-" + key, d: pathD(pts, x, y) }, chart);
  }
  const at = dsaBreakeven(w, false);
  const marker = svg("g", { id: "dsa-breakeven-marker", "data-context": at === null ? "none" : String(at) }, chart);
  if (at !== null && at >= lo && at <= hi) {
    svg("line", { x1: x.at(at), x2: x.at(at), y1: DCHART.top, y2: DCHART.height - DCHART.bottom, class: "marker" }, marker);
    svg("text", { x: x.at(at) + 4, y: DCHART.top + 12, class: "marker-label" }, marker).textContent = "break-even " + groupDigits(Math.round(at));
  } else {
    marker.setAttribute("visibility", "hidden");
  }
  svg("line", { class: "context-line", x1: x.at(state.context), x2: x.at(state.context), y1: DCHART.top, y2: DCHART.height - DCHART.bottom }, chart);
}

// ---- one answer for a DSA model: the headline card gives the sparse crossover band (what the model
// runs past index_topk), the dense figure beside it, labelled as the dense layer's

function bandText(band) {
  return band === null ? "never" : `${fixed1(band[0])} ≤ new < ${band[1] === null ? "∞" : fixed1(band[1])}`;
}

function drawHeadline(state, exact) {
  const sparse = isSparse(state.w), box = $("crossover-exact");
  $("crossover-kind").textContent = sparse ? "DSA: sparse-materialize cheaper than sparse-absorb" : "crossover at this context";
  $("limit-kind").textContent = sparse ? " (a dense layer of these widths)" : "";
  $("crossover-dense").hidden = !sparse;
  if (!sparse) {
    delete box.dataset.lower;
    delete box.dataset.upper;
    setValue("crossover-exact", exact);
    $("crossover-dense").dataset.value = "";
    return;
  }
  const band = sparseCrossover(state.w, state.context, state.counting);
  box.dataset.lower = band === null ? "none" : String(band[0]);
  box.dataset.upper = band === null || band[1] === null ? "none" : String(band[1]);
  setValue("crossover-exact", band === null ? null : band[0], bandText(band));
  setValue("crossover-dense", exact, "the dense layer's crossover: " + tokens(exact));
  $("chart-title").textContent += " (a dense layer of these widths; the DSA panel has the sparse paths)";
}

// the cache table's rows: a DSA model caches its indexer key beside the latent ("mla+indexer", first),
// "mla" stays as the latent alone (mlakit/cost/cache_size.py)
function cacheKinds(w, groups, dtype) {
  const rows = [];
  const lays = layouts(w, groups);
  if (isSparse(w)) {
    rows.push(["mla+indexer", layoutValues(lays.mla) + w.index_head_dim, layoutBytes(lays.mla, dtype) + indexKeyBytes(w, dtype)]);
  }
  for (const [kind, lay] of Object.entries(lays)) rows.push([kind, layoutValues(lay), layoutBytes(lay, dtype)]);
  return { rows, lays };
}
