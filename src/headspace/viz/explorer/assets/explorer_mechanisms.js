// headspace explorer: the mechanisms a layer may add to the classic head (issue 39), as pure functions that
// explorer.js calls (page.py joins explorer_draw.js, this file and explorer.js into one script). Each takes the
// decoded layer L ({meta, H, Hkv, dh, dm, q, k, v, WO, bO, gate, diffMaps}) and, where it needs a softmax row,
// explorer.js's own `row(L, h, t)` as rowOf. Formulas (in float64 from the stored float32 values):
//   output gate (Qwen3-Next, Qwen3.5; meta.gate [seq, H, width]):  z_h = (sum_j w_j v_j) * gate[t, h]   (hook_z)
//     width d_head: elementwise, width 1: one gate per head; the gate is this run's sigmoid(x W_G[h]).
//   differential attention (DiffLlama; meta.differential {lambda, lambda_init, n_pairs, eps, recomputed}):
//     pair j = heads (j, j + P), P = H / 2; its value head g = floor(j / (H / Hkv)) reads [v_g, v_{g + Hkv/2}]
//     D_j = P_j - lambda P_{j+P}                                   hook_diff_pattern
//     z_h = P_h [v_g, v_{g+Hkv/2}]   (g of h's pair)               hook_z [2 d_head]
//     y_j = (1 - lambda_init) (D_j [v_g, ...]) / sqrt(mean(.^2) + eps)     hook_z_normed
//     out = sum_j y_j W_O[2j : 2j + 2] + b_O   (W_O's rows of the pair's two heads, in order)
//   Where meta.differential.recomputed is false (a float16 page) D_j is the stored map (meta.diff_maps), said so.

function mechanismArrays(meta, decode) { // the decoded arrays of a layer's mechanisms
  return { gate: meta.gate ? decode(meta.gate) : null, diffMaps: meta.diff_maps ? decode(meta.diff_maps) : null,
    gateMean: meta.gate_mean ? decode(meta.gate_mean) : null };
}

function gateOf(L, h, t) { // this token's gate of head h: [width] (width d_head or 1), or null
  if (!L.gate) return null;
  const w = L.meta.gate.shape[2], o = (t * L.H + h) * w;
  return L.gate.subarray(o, o + w);
}

function gated(L, h, t, z) { // z_h times the head's output gate (in place; z unchanged without a gate)
  const g = gateOf(L, h, t);
  if (g) for (let i = 0; i < z.length; i++) z[i] *= g[g.length === 1 ? 0 : i];
  return z;
}

function diffRow(L, j, t, rowOf) { // D_j's row t: p_1 - lambda p_2, recomputed from q, k or the stored map
  const D = L.meta.differential, S = L.q.length / (L.H * L.dh);
  if (!D.recomputed) return Float64Array.from(L.diffMaps.subarray((j * S + t) * S, (j * S + t + 1) * S));
  const a = rowOf(L, j, t).weights, b = rowOf(L, j + D.n_pairs, t).weights, out = new Float64Array(S);
  for (let k = 0; k < S; k++) out[k] = a[k] - D.lambda * b[k];
  return out;
}

function pairValues(L, j, w) { // sum_k w_k [v_g, v_{g + Hkv/2}] of pair j: [2 d_head]
  const { H, Hkv, dh } = L, g = Math.floor(j / (H / Hkv)), half = Hkv / 2, z = new Float64Array(2 * dh);
  for (let k = 0; k < w.length; k++) {
    if (w[k] === 0) continue;
    for (let i = 0; i < dh; i++) {
      z[i] += w[k] * L.v[(k * Hkv + g) * dh + i];
      z[dh + i] += w[k] * L.v[(k * Hkv + g + half) * dh + i];
    }
  }
  return z;
}

function pairNormed(L, z) { // (1 - lambda_init) z / sqrt(mean(z^2) + eps): the pair's weightless norm
  const D = L.meta.differential;
  let ms = 0;
  for (const x of z) ms += x * x;
  const inv = 1 / Math.sqrt(ms / z.length + D.eps);
  return z.map((x) => (1 - D.lambda_init) * x * inv);
}

// Head h of a differential layer at token t: its own z (hook_z), the pairs' normed z concatenated (the
// concat W_O reads), the part of h's pair, the layer output, and the pair's difference row.
function diffCompute(L, h, t, rowOf) {
  const P = L.meta.differential.n_pairs, width = 2 * L.dh, pair = h % P;
  const concat = new Float64Array(L.H * L.dh), out = new Float64Array(L.dm);
  let contrib = null, dRow = null;
  for (let j = 0; j < P; j++) {
    const d = diffRow(L, j, t, rowOf), y = pairNormed(L, pairValues(L, j, d));
    concat.set(y, j * width);
    const c = new Float64Array(L.dm);
    for (let i = 0; i < width; i++) for (let m = 0; m < L.dm; m++) c[m] += y[i] * L.WO[(j * width + i) * L.dm + m];
    for (let m = 0; m < L.dm; m++) out[m] += c[m];
    if (j === pair) { contrib = c; dRow = d; }
  }
  if (L.bO) for (let m = 0; m < L.dm; m++) out[m] += L.bO[m];
  return { z: pairValues(L, pair, rowOf(L, h, t).weights), concat, contrib, out, pair, diff: dRow };
}

// What the heads view says of a layer's mechanisms (appended to its note).
function mechanismNote(L, shown, t) {
  let s = "";
  if (L.gate) {
    s += `; ${L.meta.gate_label}; mean gate of token ${t}: ` +
      shown.map((h) => `H${h} ${fmt(L.gateMean[t * L.H + h], 3)}`).join(", ");
  }
  const D = L.meta.differential;
  if (D) s += `; differential pairs (j, j + ${D.n_pairs}), lambda = ${fmt(D.lambda, 4)}` +
    (D.recomputed ? "" : " (difference maps: the stored hook_diff_pattern, not recomputed from q, k)");
  return s;
}

// The pipeline's mechanism lines: the gate of this head and token, and the pair's difference map row.
function mechanismView(box, L, h, t, r, tokens, rowOf) {
  const g = gateOf(L, h, t);
  if (g) {
    const s = document.createElement("span");
    s.className = "mechanism gate";
    s.textContent = `gate sigmoid(x W_G[${h}]) of this token (${L.meta.gate_kind}, z above is gated): ` +
      Array.from(g, (x) => fmt(x, 3)).join(" ");
    box.append(s);
  }
  if (r.diff) {
    const s = document.createElement("span");
    s.className = "mechanism diff";
    const P = L.meta.differential.n_pairs;
    s.textContent = `pair ${r.pair} (heads ${r.pair}, ${r.pair + P}): p_1 - lambda p_2 = ` +
      Array.from(r.diff, (x, j) => `${tokens[j]} ${fmt(x, 3)}`).join(", ") +
      (L.meta.differential.recomputed ? "" : " (stored map)") + "; z above is head " + h + "'s own (hook_z)";
    box.append(s);
  }
  drawDiffMap(L, t, r, tokens, rowOf);
}

// The whole map D_j of the selected head's pair [seq_q, seq_k] (diverging: D may be negative), row t outlined.
function drawDiffMap(L, t, r, tokens, rowOf) {
  const view = document.getElementById("diff-view");
  view.hidden = !r.diff;
  if (!r.diff) return;
  const S = tokens.length, D = [];
  for (let i = 0; i < S; i++) D.push(diffRow(L, r.pair, i, rowOf));
  let m = 0;
  for (const d of D) m = Math.max(m, maxAbs(d));
  const canvas = document.getElementById("diff-canvas"), cell = Math.max(1, Math.min(36, Math.floor(560 / S)));
  const labels = S <= 48 ? tokens : null;
  const ctx = paintGrid(canvas, S, S, (i, j) => diverging(D[i][j], m),
    { cw: cell, ch: cell, ox: labels ? 90 : 0, oy: labels ? 70 : 0, rowLabels: labels, colLabels: labels });
  outline(ctx, canvas, t, 0, 1, S, "#e8710a");
  canvas.dataset.pair = String(r.pair);
  const box = document.getElementById("diff-legend");
  box.replaceChildren();
  legend(box, "div", -m, m, `D_${r.pair} (${L.meta.differential.recomputed ? "recomputed from q, k" : "stored"})`);
}
