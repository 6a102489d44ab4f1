"use strict";
// What the inputs read, as the CLI reads its flags: token counts (mlakit/commands/args.py parse_count:
// 4K = 4,096, 1M = 1,048,576) and byte sizes (mlakit/commands/capacity.py parse_bytes: GB = 10^9,
// GiB = 2^30). null: refused (the caller says so and shows no figure).

const COUNT_SUFFIX = { k: 2 ** 10, m: 2 ** 20, g: 2 ** 30 };
const BYTE_UNITS = { "": 1, b: 1, kb: 1e3, mb: 1e6, gb: 1e9, tb: 1e12, pb: 1e15, kib: 2 ** 10, mib: 2 ** 20, gib: 2 ** 30, tib: 2 ** 40, pib: 2 ** 50 };
const MAX_BYTES = 2 ** 53;

function parseCount(text, low, high) {
  const part = String(text).trim().toLowerCase().replace(/_/g, "");
  const scale = (part && COUNT_SUFFIX[part.slice(-1)]) || 1;
  const digits = scale > 1 ? part.slice(0, -1) : part;
  if (!/^[0-9]+$/.test(digits) || digits.length > 15) return null;
  const value = Number(digits) * scale;
  return value >= low && value <= high ? value : null;
}

function parseBytes(text) {
  const m = /^\s*([0-9]+(?:\.[0-9]+)?(?:e[0-9]+)?)\s*([a-z]*)\s*$/i.exec(String(text));
  if (!m || !(m[2].toLowerCase() in BYTE_UNITS)) return null;
  const value = Math.floor(Number(m[1]) * BYTE_UNITS[m[2].toLowerCase()] + 0.5);
  return value >= 1 && value <= MAX_BYTES ? value : null;
}

// floor(a / b) of integers below 2^53, exact (a float quotient can round up to the next integer)
function floorDiv(a, b) {
  let q = Math.floor(a / b);
  while (q * b > a) q -= 1;
  while ((q + 1) * b <= a) q += 1;
  return q;
}
