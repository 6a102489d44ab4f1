"use strict";
// The explorer receives the formulas' inputs (preset widths, cache format constants, bench rows)
// and computes every figure it shows here; tests/test_explore.py checks them against mlakit.cost.

const INPUTS = JSON.parse(document.getElementById("mlakit-inputs").textContent);
const FIELDS = ["num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_layers"];
const PATHS = ["materialize", "absorb"];

// ---- the cost model: mirrors mlakit/cost/terms.py and mlakit/cost/crossover.py

function keysSeen(n, c, counting) {
  return counting === "independent" ? n * c : n * c + (n * (n + 1)) / 2;
}

function expandedTokens(n, c, counting) {
  return counting === "independent" ? c : c + n;
}

function pathMacs(w, mode, n, c, counting) {
  const h = w.num_heads, L = w.kv_lora_rank, dn = w.qk_nope_head_dim, dr = w.qk_rope_head_dim, dv = w.v_head_dim;
  const pairs = keysSeen(n, c, counting);
  if (mode === "materialize") {
    const t = expandedTokens(n, c, counting);
    return t * h * dn * L + t * h * dv * L + pairs * h * (dn + dr) + pairs * h * dv;
  }
  return n * h * dn * L + pairs * h * (L + dr) + pairs * h * L + n * h * L * dv;
}

function firstCrossing(a, b, c) {
  if (c < 0) return 0;
  if (Math.abs(a) <= 1e-12 * Math.max(Math.abs(b), Math.abs(c), 1)) return b < 0 ? c / -b + 0 : null;
  const disc = b * b - 4 * a * c;
  if (disc <= 0) return null;
  const q = -(b + (b < 0 || Object.is(b, -0) ? -1 : 1) * Math.sqrt(disc)) / 2;
  const lo = Math.min(q / a, c / q), hi = Math.max(q / a, c / q);
  if (a < 0) return Math.max(hi, 0) + 0;
  return lo >= 0 ? lo : null;
}

function crossover(w, c, counting) {
  const g = [0, 1, 2].map((n) => pathMacs(w, "materialize", n, c, counting) - pathMacs(w, "absorb", n, c, counting));
  const twoA = g[2] - 2 * g[1] + g[0];
  return firstCrossing(twoA, 2 * (g[1] - g[0]) - twoA, 2 * g[0]);
}

function asymptotic(w) {
  const denom = 2 * w.kv_lora_rank - w.qk_nope_head_dim - w.v_head_dim;
  return denom <= 0 ? null : (w.kv_lora_rank * (w.qk_nope_head_dim + w.v_head_dim)) / denom;
}

// ---- cache sizes: mirrors mlakit/cost/cache_size.py

function layouts(w, groups) {
  const h = w.num_heads, dn = w.qk_nope_head_dim, dv = w.v_head_dim;
  const out = {
    mla: { vectors: [[1, w.kv_lora_rank]], rope: w.qk_rope_head_dim },
    expanded: { vectors: [[h, dn], [h, dv]], rope: h * w.qk_rope_head_dim },
    mha: { vectors: [[h, dn], [h, dv]], rope: 0 },
  };
  for (const g of groups) {
    if (g > 1 && g < h && h % g === 0) out["gqa" + g] = { vectors: [[g, dn], [g, dv]], rope: 0 };
  }
  out.mqa = { vectors: [[1, dn], [1, dv]], rope: 0 };
  return out;
}

function layoutValues(lay) {
  return lay.vectors.reduce((s, [count, width]) => s + count * width, 0) + lay.rope;
}

function layoutBytes(lay, dtype) {
  const f = INPUTS.cache_format, quantized = dtype === "fp8" || dtype === "int8";
  let total = 0;
  for (const [count, width] of lay.vectors) {
    total += count * width * f.value_bytes[dtype];
    if (quantized) {
      const tiles = dtype in f.quant_tile ? Math.ceil(width / f.quant_tile[dtype]) : 1;
      total += count * tiles * f.scale_bytes;
    }
  }
  return total + lay.rope * (quantized ? f.rope_bytes : f.value_bytes[dtype]);
}

function formatBytes(n) {
  const units = ["B", "kB", "MB", "GB", "TB", "PB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) {
    n /= 1000;
    i += 1;
  }
  const digits = i === 0 || n >= 100 ? 0 : n >= 10 ? 1 : 2;
  const scale = 10 ** digits;
  return (Math.floor(n * scale + 0.5) / scale).toFixed(digits) + " " + units[i];
}

function groupDigits(n) {
  return String(n).replace(/\B(?=(\d{3})+(?!\d))/g, ",");
}

// ---- measured times: mirrors mlakit/cost/measured.py

function series(rows, backend, cached, batch, dtype) {
  return rows
    .filter((r) => r.backend === backend && r.cached === cached && r.batch === batch && r.dtype === dtype)
    .map((r) => [r.new, r.ms_median])
    .sort((a, b) => a[0] - b[0]);
}

function measuredCrossover(rows, cached, batch, dtype) {
  const absorb = new Map(series(rows, "mlakit-absorb", cached, batch, dtype));
  const mat = new Map(series(rows, "mlakit-materialize", cached, batch, dtype));
  const common = [...absorb.keys()].filter((n) => mat.has(n)).sort((a, b) => a - b);
  let prev = null;
  for (const n of common) {
    const r = Math.log(mat.get(n) / absorb.get(n));
    if (r <= 0) {
      if (prev === null) return n;
      const [n0, r0] = prev;
      return Math.exp(Math.log(n0) + ((Math.log(n) - Math.log(n0)) * r0) / (r0 - r));
    }
    prev = [n, r];
  }
  return null;
}

// ---- terms, bytes and the roofline: mirrors mlakit/cost/terms.py, traffic.py, roofline.py, and the
// batched step of mlakit/bench/costs.py (what a bench row times: projections + core, B sequences)

function pathTerms(w, mode, n, c, counting) {
  const h = w.num_heads, L = w.kv_lora_rank, dn = w.qk_nope_head_dim, dr = w.qk_rope_head_dim, dv = w.v_head_dim;
  const pairs = keysSeen(n, c, counting);
  if (mode === "materialize") {
    const t = expandedTokens(n, c, counting);
    return { expand_k: t * h * dn * L, expand_v: t * h * dv * L, scores: pairs * h * (dn + dr), weighted_sum: pairs * h * dv };
  }
  return { fold_q: n * h * dn * L, scores: pairs * h * (L + dr), mix_latents: pairs * h * L, unfold_v: n * h * L * dv };
}

function projShapes(w) {
  const d = w.hidden_size, qw = w.num_heads * (w.qk_nope_head_dim + w.qk_rope_head_dim);
  const s = {};
  if (!w.q_lora_rank) s.q_proj = [d, qw];
  else {
    s.q_a_proj = [d, w.q_lora_rank];
    s.q_b_proj = [w.q_lora_rank, qw];
  }
  s.kv_a_proj_with_mqa = [d, w.kv_lora_rank + w.qk_rope_head_dim];
  s.o_proj = [w.num_heads * w.v_head_dim, d];
  return s;
}

function sharedMacs(w, n) {
  const out = {};
  for (const [k, [i, o]] of Object.entries(projShapes(w))) out[k] = n * i * o;
  return out;
}

function computeDtype(dtype) {
  return dtype === "fp32" ? "fp32" : "bf16";
}

function sharedBytes(w, n, dtype) {
  const e = INPUTS.cache_format.value_bytes[computeDtype(dtype)], out = {};
  for (const [k, [i, o]] of Object.entries(projShapes(w))) out[k] = (n * i + i * o + n * o) * e;
  return out;
}

function cacheRowBytes(w, dtype) {
  const lay = { vectors: [[1, w.kv_lora_rank]], rope: w.qk_rope_head_dim };
  const rope = layoutBytes({ vectors: [], rope: lay.rope }, dtype);
  return [layoutBytes(lay, dtype) - rope, rope];
}

function pathBytes(w, mode, n, c, counting, dtype) {
  const h = w.num_heads, L = w.kv_lora_rank, dn = w.qk_nope_head_dim, dr = w.qk_rope_head_dim, dv = w.v_head_dim;
  const e = INPUTS.cache_format.value_bytes[computeDtype(dtype)];
  const [latent, rope] = cacheRowBytes(w, dtype);
  const t = expandedTokens(n, c, counting), nh = n * h;
  if (mode === "materialize") {
    return {
      expand_k: t * latent + h * dn * L * e + t * h * dn * e,
      expand_v: h * dv * L * e + t * h * dv * e,
      scores: nh * (dn + dr) * e + t * rope + t * h * dn * e,
      weighted_sum: t * h * dv * e + nh * dv * e,
    };
  }
  return {
    fold_q: nh * dn * e + h * dn * L * e + nh * L * e,
    scores: nh * (L + dr) * e + t * (latent + rope),
    mix_latents: nh * L * e,
    unfold_v: nh * L * e + h * L * dv * e + nh * dv * e,
  };
}

function termsSeconds(macs, bytes, machine, dtype) {
  const flops = machine.peak_flops[computeDtype(dtype)];
  let total = 0;
  for (const k of Object.keys(macs)) total += Math.max((2 * macs[k]) / flops, bytes[k] / machine.memory_bandwidth);
  return total;
}

function pathSeconds(w, mode, n, c, counting, dtype, machine) {
  return termsSeconds(pathTerms(w, mode, n, c, counting), pathBytes(w, mode, n, c, counting, dtype), machine, dtype);
}

function batched(perSeq, weights, b) {
  const out = {};
  for (const k of Object.keys(perSeq)) out[k] = b * perSeq[k] - (b - 1) * weights[k];
  return out;
}

function scaled(terms, b) {
  const out = {};
  for (const k of Object.keys(terms)) out[k] = b * terms[k];
  return out;
}

// one layer step of `b` sequences (projections + core), as a bench row times it
function stepSeconds(w, mode, b, n, c, counting, dtype, machine) {
  const macs = { ...scaled(sharedMacs(w, n), b), ...scaled(pathTerms(w, mode, n, c, counting), b) };
  const bytes = {
    ...batched(sharedBytes(w, n, dtype), sharedBytes(w, 0, dtype), b),
    ...batched(pathBytes(w, mode, n, c, counting, dtype), pathBytes(w, mode, 0, 0, counting, dtype), b),
  };
  return termsSeconds(macs, bytes, machine, dtype);
}

function rooflineCrossover(w, c, machine, dtype, counting, maxNew = 2 ** 24) {
  const gap = (n) => pathSeconds(w, "materialize", n, c, counting, dtype, machine) - pathSeconds(w, "absorb", n, c, counting, dtype, machine);
  let prev = 0;
  if (gap(prev) <= 0) return 0;
  for (let k = 0; k <= 8 * Math.ceil(Math.log2(maxNew)); k++) {
    const n = 2 ** (k / 8);
    if (gap(n) <= 0) {
      let lo = prev, hi = n;
      while (hi - lo > 1e-9 * hi) {
        const mid = (lo + hi) / 2;
        if (gap(mid) <= 0) hi = mid;
        else lo = mid;
      }
      return hi;
    }
    prev = n;
  }
  return null;
}

function formatSeconds(s) {
  for (const [unit, scale] of [["s", 1], ["ms", 1e-3], ["µs", 1e-6], ["ns", 1e-9]]) {
    if (Math.abs(s) >= scale || unit === "ns") return Number((s / scale).toPrecision(3)) + " " + unit;
  }
  return s + " s";
}
