"use strict";
// The capacity panel: concurrent sequences of the context per rank after the weights, every cache
// kind; mirrors mlakit/cost/capacity.py (what `mlakit cache --memory` prints).

const MLA_DTYPES = ["bf16", "fp8", "int8"];
const CAPACITY_INPUTS = ["capacity-memory", "capacity-tp", "capacity-cp", "capacity-weights-memory", "capacity-weights-dtype"];

function ownedTokensMax(context, cp) {
  const size = INPUTS.capacity.block_size, blocks = Math.floor(context / size);
  return Math.ceil(blocks / cp) * size + (blocks % cp === 0 ? context % size : 0);
}

function weightsBytes(name, weightsDtype, weightsMemory) {
  if (weightsMemory !== null) return { source: "given", parameters: null, dtype: null, bytes: weightsMemory };
  const params = INPUTS.capacity.parameters[name];
  if (params === undefined || params === null) return null;
  return { source: "parameters", parameters: params, dtype: weightsDtype, bytes: Math.round(params * INPUTS.capacity.weight_bytes[weightsDtype]) };
}

function perRankTokenBytes(w, dtype, tp, groups) {
  const out = {}, lays = layouts(w, groups), sparse = isSparse(w);
  for (const d of dtype === "fp32" ? [...MLA_DTYPES, "fp32"] : MLA_DTYPES) {
    const perLayer = layoutBytes(lays.mla, d) + (sparse ? indexKeyBytes(w, d) : 0);
    out[(sparse ? "mla+indexer-" : "mla-") + d] = { dtype: d, perLayer, note: "latent replicated over tp" };
  }
  for (const [name, lay] of Object.entries(lays)) {
    if (name === "mla") continue;
    const heads = lay.vectors[0][0], onRank = Math.ceil(heads / tp);
    out[name] = { dtype, perLayer: (layoutBytes(lay, dtype) / heads) * onRank, note: `${onRank} of ${heads} cached heads per rank` };
  }
  return out;
}

// null when the weights are unknown (no published parameter count and no weights memory given)
function capacity(name, w, context, memory, dtype, tp, cp, weightsMemory, weightsDtype, groups) {
  const weights = weightsBytes(name, weightsDtype, weightsMemory);
  if (weights === null) return null;
  weights.bytes_per_rank = floorDiv(weights.bytes + tp - 1, tp);
  const free = Math.max(0, memory - weights.bytes_per_rank), tokens = ownedTokensMax(context, cp);
  const caches = {};
  for (const [kind, r] of Object.entries(perRankTokenBytes(w, dtype, tp, groups))) {
    const perSeq = r.perLayer * w.num_layers * tokens;
    caches[kind] = { dtype: r.dtype, per_layer: r.perLayer, per_sequence: perSeq, sequences: floorDiv(free, perSeq), note: r.note };
  }
  return { weights, free, tokens, caches };
}

// ---- the panel

function readCapacity(w) {
  const errors = [];
  const memory = parseBytes($("capacity-memory").value);
  if (memory === null) errors.push(`memory per rank takes a size (80GB = 80·10^9 bytes, 80GiB = 80·2^30), got "${$("capacity-memory").value}"`);
  const tp = parseCount($("capacity-tp").value, 1, 1 << 16), cp = parseCount($("capacity-cp").value, 1, 1 << 16);
  if (tp === null) errors.push(`tensor-parallel ranks must be a whole number from 1, got "${$("capacity-tp").value}"`);
  else if (Number.isInteger(w.num_heads) && tp > w.num_heads) errors.push(`tp=${tp} exceeds the ${w.num_heads} heads`);
  if (cp === null) errors.push(`context-parallel ranks must be a whole number from 1, got "${$("capacity-cp").value}"`);
  const given = $("capacity-weights-memory").value.trim();
  const weightsMemory = given === "" ? null : parseBytes(given);
  if (given !== "" && weightsMemory === null) errors.push(`weights memory takes a size (1.3TB, 80GiB) or nothing, got "${given}"`);
  return { inputs: { memory, tp, cp, weightsMemory, weightsDtype: $("capacity-weights-dtype").value }, errors };
}

function drawCapacity(state) {
  const c = state.capacity, body = $("capacity-body");
  body.replaceChildren();
  $("capacity-context-label").textContent = groupDigits(state.context);
  const r = capacity(state.name, state.w, state.context, c.memory, state.dtype, c.tp, c.cp, c.weightsMemory, c.weightsDtype, state.groups);
  const note = $("capacity-arithmetic");
  if (r === null) {
    note.dataset.free = "none";
    note.textContent = `No published parameter count for ${state.name}: give the weights' memory.`;
    return;
  }
  note.dataset.free = String(r.free);
  note.dataset.weightsPerRank = String(r.weights.bytes_per_rank);
  note.dataset.tokens = String(r.tokens);
  const how = r.weights.source === "given"
    ? `${formatBytes(r.weights.bytes)} (given)`
    : `${Number(r.weights.parameters.toPrecision(4)).toExponential()} parameters × ${INPUTS.capacity.weight_bytes[r.weights.dtype]} B (${r.weights.dtype}) = ${formatBytes(r.weights.bytes)}`;
  note.textContent =
    `Weights ${how}, / tp ${c.tp} = ${formatBytes(r.weights.bytes_per_rank)} per rank; free ${formatBytes(c.memory)} − ${formatBytes(r.weights.bytes_per_rank)} = ${formatBytes(r.free)}. ` +
    `A sequence keeps ${groupDigits(r.tokens)} tokens on the fullest cp rank; sequences = floor(free / (B/token/layer × ${state.w.num_layers} layers × ${groupDigits(r.tokens)} tokens)).` +
    (r.free === 0 ? " The weights alone fill the memory: no sequence fits." : "");
  for (const [kind, x] of Object.entries(r.caches)) {
    const tr = document.createElement("tr");
    tr.dataset.kind = kind;
    for (const [cls, value, text] of [
      ["kind", null, kind],
      ["dtype", null, x.dtype],
      ["per-layer", x.per_layer, groupDigits(x.per_layer)],
      ["per-sequence", x.per_sequence, formatBytes(x.per_sequence)],
      ["sequences", x.sequences, groupDigits(x.sequences)],
      ["arithmetic", null, `floor(${formatBytes(r.free)} / ${formatBytes(x.per_sequence)}); ${x.note}`],
    ]) {
      const td = document.createElement("td");
      td.className = cls;
      if (value !== null) td.dataset.value = String(value);
      td.textContent = text;
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}

function initCapacity() {
  const sel = $("capacity-weights-dtype");
  for (const d of Object.keys(INPUTS.capacity.weight_bytes)) sel.add(new Option(d, d));
  sel.value = "bf16";
}
