"use strict";
// DeepSeek Sparse Attention: mirrors mlakit/cost/sparse.py (and index_key_bytes, the indexer rows of
// cache_economics in cache_size.py); term by term, in the same order, so the sums round the same way.

const SPARSE_MODES = ["sparse-absorb", "sparse-materialize"];

function isSparse(w) {
  return w.index_topk !== null && w.index_topk !== undefined;
}

function sumValues(terms) {
  return Object.values(terms).reduce((s, v) => s + v, 0);
}

function needsIndexer(w, n, c, counting) {
  return c + (counting === "causal" ? n : 0) > w.index_topk;
}

// (query, key) pairs attended: Σ_i min(k, keys query i sees)
function selectedPairs(w, n, c, counting) {
  const k = w.index_topk;
  if (counting === "independent") return n * Math.min(k, c);
  const below = Math.max(0, Math.min(n, k - c)); // queries that see <= k keys
  return below * c + (below * (below + 1)) / 2 + (n - below) * k;
}

function indexerMacs(w, n, c, counting) {
  const on = needsIndexer(w, n, c, counting);
  const hi = w.index_n_heads, di = w.index_head_dim, d = w.hidden_size;
  const pairs = on ? keysSeen(n, c, counting) : 0;
  return {
    index_wq_b: on ? n * w.q_lora_rank * hi * di : 0,
    index_wk: n * d * di,
    index_weights: on ? n * d * hi : 0,
    index_scores: pairs * hi * (di + 1),
  };
}

function sparseAbsorbMacs(w, n, c, counting) {
  const h = w.num_heads, L = w.kv_lora_rank, dn = w.qk_nope_head_dim, dr = w.qk_rope_head_dim, dv = w.v_head_dim;
  const pairs = selectedPairs(w, n, c, counting);
  return { fold_q: n * h * dn * L, scores: pairs * h * (L + dr), mix_latents: pairs * h * L, unfold_v: n * h * L * dv };
}

// sparse-materialize is the dense masked form: dense materialize's terms over every visible pair
function sparsePathTerms(w, mode, n, c, counting) {
  const core = mode === "sparse-absorb" ? sparseAbsorbMacs(w, n, c, counting) : pathTerms(w, "materialize", n, c, counting);
  return { ...core, ...indexerMacs(w, n, c, counting) };
}

function sparsePathMacs(w, mode, n, c, counting) {
  return sumValues(sparsePathTerms(w, mode, n, c, counting));
}

function chooseSparse(w, n, c) {
  const a = sparsePathMacs(w, "sparse-absorb", n, c, "causal");
  const m = sparsePathMacs(w, "sparse-materialize", n, c, "causal");
  return m < a ? "sparse-materialize" : "sparse-absorb";
}

// [lower, upper]: sparse-materialize costs fewer multiply-adds for lower <= new < upper (upper null:
// up to maxNew); null: never
function sparseCrossover(w, c, counting, maxNew = 2 ** 22) {
  const gap = (n) => sparsePathMacs(w, "sparse-materialize", n, c, counting) - sparsePathMacs(w, "sparse-absorb", n, c, counting);
  const grid = [];
  for (let i = 0; i < 8 * Math.floor(Math.log2(maxNew)) + 1; i++) grid.push(2 ** (i / 8));
  const first = grid.findIndex((n) => gap(n) < 0);
  if (first < 0) return null;
  const lower = first === 0 ? grid[0] : bisectEdge(gap, grid[first - 1], grid[first]);
  let last = -1;
  for (let i = first; i < grid.length; i++) {
    if (gap(grid[i]) >= 0) {
      last = i;
      break;
    }
  }
  return [lower, last < 0 ? null : bisectEdge(gap, grid[last - 1], grid[last])];
}

function bisectEdge(gap, lo, hi) {
  const negHi = gap(hi) < 0;
  while (hi - lo > 1e-9 * hi) {
    const mid = (lo + hi) / 2;
    if ((gap(mid) < 0) === negHi) hi = mid;
    else lo = mid;
  }
  return hi;
}

function independentSparseCrossover(w, c) {
  const L = w.kv_lora_rank, dn = w.qk_nope_head_dim, dr = w.qk_rope_head_dim, dv = w.v_head_dim;
  const denom = L * (dn + dv) + (2 * L + dr) * w.index_topk - c * (dn + dr + dv);
  return denom > 0 ? (c * L * (dn + dv)) / denom : null;
}

// ---- one decode step: context-dependent terms, H(2L+dr)·T dense against H(2L+dr)·min(T,k) + H_I(d_I+1)·T

function denseCoreMacs(w, c) {
  return c * w.num_heads * (2 * w.kv_lora_rank + w.qk_rope_head_dim);
}

function sparseCoreMacs(w, c) {
  return {
    attention: Math.min(c, w.index_topk) * w.num_heads * (2 * w.kv_lora_rank + w.qk_rope_head_dim),
    index_scores: c * w.index_n_heads * (w.index_head_dim + 1),
  };
}

// null where the page has no finite answer (an indexer that scores a key for more than attention spends)
function dsaBreakeven(w, includeProjections) {
  const perKey = w.num_heads * (2 * w.kv_lora_rank + w.qk_rope_head_dim);
  let fixed = perKey * w.index_topk;
  if (includeProjections) {
    const p = indexerMacs(w, 1, w.index_topk + 1, "independent");
    fixed += 0 + p.index_wq_b + p.index_wk + p.index_weights;
  }
  const denom = perKey - w.index_n_heads * (w.index_head_dim + 1);
  return denom > 0 ? fixed / denom : null;
}

function indexKeyBytes(w, dtype) {
  const f = INPUTS.cache_format, d = w.index_head_dim;
  if (dtype === "fp8" || dtype === "int8") {
    const groups = dtype === "fp8" && d % f.index_tile === 0 ? d / f.index_tile : 1;
    return d + groups * f.scale_bytes;
  }
  return d * f.value_bytes[dtype];
}

function dsaBreakevenBytes(w, dtype, indexDtype) {
  const [latent, rope] = cacheRowBytes(w, dtype);
  const row = latent + rope, denom = row - indexKeyBytes(w, indexDtype || dtype);
  return denom > 0 ? (w.index_topk * row) / denom : null;
}

function dsaDecodeSummary(w, c) {
  const core = sparseCoreMacs(w, c), denseCore = denseCoreMacs(w, c);
  const sparseAll = sparsePathTerms(w, "sparse-absorb", 1, c, "independent");
  const denseAll = sumValues(pathTerms(w, "absorb", 1, c, "independent"));
  const indexAll = Object.entries(sparseAll).reduce((s, [k, v]) => (k.startsWith("index_") ? s + v : s), 0);
  const sCore = sumValues(core), sAll = sumValues(sparseAll);
  return {
    core: { dense: denseCore, sparse: sCore, index: core.index_scores, ratio: denseCore / sCore, indexer_share: core.index_scores / sCore },
    all_terms: { dense: denseAll, sparse: sAll, index: indexAll, ratio: denseAll / sAll, indexer_share: indexAll / sAll },
  };
}

// ---- bytes: mirrors indexer_bytes, sparse_absorb_bytes, sparse_path_bytes

function indexerBytes(w, n, c, counting, dtype) {
  const e = INPUTS.cache_format.value_bytes[computeDtype(dtype)], key = indexKeyBytes(w, dtype);
  const hi = w.index_n_heads, di = w.index_head_dim, d = w.hidden_size, q = w.q_lora_rank;
  const on = needsIndexer(w, n, c, counting);
  const t = on ? expandedTokens(n, c, counting) : 0;
  return {
    index_wq_b: on ? (n * q + q * hi * di + n * hi * di) * e : 0,
    index_wk: (n * d + d * di) * e + n * key,
    index_weights: on ? (n * d + d * hi) * 4 + n * hi * 4 : 0,
    index_scores: t * key + (on ? n * (hi * di * e + hi * 4) : 0),
  };
}

function sparseAbsorbBytes(w, n, c, counting, dtype) {
  const h = w.num_heads, L = w.kv_lora_rank, dn = w.qk_nope_head_dim, dr = w.qk_rope_head_dim, dv = w.v_head_dim;
  const e = INPUTS.cache_format.value_bytes[computeDtype(dtype)];
  const [latent, rope] = cacheRowBytes(w, dtype);
  const rows = Math.min(expandedTokens(n, c, counting), n * w.index_topk), nh = n * h;
  return {
    fold_q: nh * dn * e + h * dn * L * e + nh * L * e,
    scores: nh * (L + dr) * e + rows * (latent + rope) + n * w.index_topk * 4,
    mix_latents: nh * L * e,
    unfold_v: nh * L * e + h * L * dv * e + nh * dv * e,
  };
}

function sparsePathBytes(w, mode, n, c, counting, dtype) {
  const core = mode === "sparse-absorb" ? sparseAbsorbBytes(w, n, c, counting, dtype) : pathBytes(w, "materialize", n, c, counting, dtype);
  return { ...core, ...indexerBytes(w, n, c, counting, dtype) };
}

// the indexer rows of cache_economics: one key per token per layer beside the latent
function indexerCache(w, c, dtype) {
  const key = indexKeyBytes(w, dtype);
  const withKey = layoutBytes(layouts(w, []).mla, dtype) + key;
  return { key, per_layer: withKey, per_token: withKey * w.num_layers, per_sequence: withKey * w.num_layers * c };
}
