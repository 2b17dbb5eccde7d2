// headspace explorer: draws the data embedded in the page (#explorer-data); makes no request.
//
// Stored per layer (see headspace/viz/explorer/data.py): q [seq, H, dh], k and v [seq, Hkv, dh],
// W_O [H, dh, d_model] (floats, or "grid4" codes: decodeGrid), b_O [d_model], shares [seq, H], overlaps.
// Everything else is computed here with the model's own formulas, in float64:
//   score_j = (q_t . k_j) * scale - alibi_h (t - j)  (masked keys excluded)   w = softmax(score)   z_h = sum_j w_j v_j
//   learned sinks (layer.sinks, gpt-oss): w_j = exp(score_j) / (sum_k exp(score_k) + exp(s_h)), sink = 1 - sum_j w_j
//   out = sum_h z_h W_O[h] + b_O
// Output gates (z_h times the run's gate) and differential pairs (DiffLlama): explorer_mechanisms.js.
// DATA.results (optional): saved patching / attribution results, drawn as they are (view 5).
// A large page (blob.py) holds its arrays as one deflated block (#explorer-blob, one byte a character,
// NUL, CR, "<" and "~" written as "~" and the byte + 64); an array's fields then say where its bytes are.
"use strict";
(async function () {
  const DATA = JSON.parse(document.getElementById("explorer-data").textContent);
  const BLOB = DATA.blob ? await inflateBlock(document.getElementById("explorer-blob").textContent, DATA.blob.bytes) : null;
  const TOKENS = DATA.tokens;
  const SEQ = TOKENS.length;
  const N_LAYERS = DATA.layers.length;
  const LONG = SEQ > 64; // long inputs: top-k edges, no per-row labels, top rows in tables
  const TABLE_ROWS = 24;
  const LINE_TOP_K = 3;
  const $ = (id) => document.getElementById(id);

  function decode(a) { return decodeArray(a, BLOB); } // explorer_draw.js

  const decoded = new Map();
  function layerData(l) {
    if (!decoded.has(l)) {
      const L = DATA.layers[l];
      const overlap = {};
      for (const key of Object.keys(L.overlap)) overlap[key] = { shape: L.overlap[key].shape, v: decode(L.overlap[key]) };
      decoded.set(l, {
        meta: L, H: L.n_heads, Hkv: L.n_kv_heads, dh: L.d_head, dm: L.d_model,
        q: decode(L.q), k: decode(L.k), v: decode(L.v), WO: decode(L.W_O), bO: decode(L.b_O),
        shares: decode(L.shares), overlap: overlap, patterns: new Map(), ...mechanismArrays(L, decode), // explorer_mechanisms.js
      });
    }
    return decoded.get(l);
  }

  // ------------------------------------------------------------------ the model's maths
  function kvHead(L, h) { return Math.floor(h / (L.H / L.Hkv)); }
  function allowed(L, t, j) { const m = L.meta.mask, w = L.meta.window; // "window": causal, the last w keys; "band": |t - j| < w; "chunk": causal, t's chunk of w
    return m === "none" || (m === "band" ? Math.abs(t - j) < w : j <= t && (m === "chunk" ? Math.floor(j / w) === Math.floor(t / w) : m !== "window" || t - j < w)); }

  // One query row of one head: {scores, weights, sink} (masked keys: score -Infinity, weight 0; sink: 0 without).
  function row(L, h, t) {
    const { H, Hkv, dh } = L, g = kvHead(L, h), scale = L.meta.scale, slope = L.meta.alibi ? L.meta.alibi[h] : 0;
    const scores = new Float64Array(SEQ), weights = new Float64Array(SEQ);
    const qo = (t * H + h) * dh;
    const qs = new Float64Array(dh);
    for (let i = 0; i < dh; i++) qs[i] = L.q[qo + i] * scale;
    const K = L.k;
    let max = -Infinity;
    for (let j = 0; j < SEQ; j++) {
      if (!allowed(L, t, j)) { scores[j] = -Infinity; continue; }
      const ko = (j * Hkv + g) * dh;
      let s = 0;
      for (let i = 0; i < dh; i++) s += qs[i] * K[ko + i];
      scores[j] = s - slope * (t - j); // ALiBi: -m_h (t - j)
      if (scores[j] > max) max = scores[j];
    }
    const sinkLogit = L.meta.sinks ? L.meta.sinks[h] : null;
    if (sinkLogit !== null && sinkLogit > max) max = sinkLogit; // the sink joins the row's maximum
    let sum = 0;
    for (let j = 0; j < SEQ; j++) {
      const e = scores[j] === -Infinity ? 0 : Math.exp(scores[j] - max);
      weights[j] = e;
      sum += e;
    }
    const sinkExp = sinkLogit === null ? 0 : Math.exp(sinkLogit - max);
    sum += sinkExp;
    for (let j = 0; j < SEQ; j++) weights[j] = sum > 0 ? weights[j] / sum : 0;
    return { scores, weights, sink: sum > 0 ? sinkExp / sum : 0 };
  }

  // The whole pattern of one head [seq_q, seq_k], computed once per (layer, head).
  function pattern(L, h) {
    if (!L.patterns.has(h)) {
      const p = new Float32Array(SEQ * SEQ);
      for (let t = 0; t < SEQ; t++) p.set(row(L, h, t).weights, t * SEQ);
      L.patterns.set(h, p);
    }
    return L.patterns.get(h);
  }

  function zOf(L, h, t, weights) {
    const { Hkv, dh } = L, g = kvHead(L, h);
    const w = weights || row(L, h, t).weights;
    const z = new Float64Array(dh);
    for (let j = 0; j < SEQ; j++) {
      if (w[j] === 0) continue;
      const vo = (j * Hkv + g) * dh;
      for (let i = 0; i < dh; i++) z[i] += w[j] * L.v[vo + i];
    }
    return gated(L, h, t, z); // an output gate multiplies z_h (explorer_mechanisms.js)
  }

  function contribution(L, h, z) { // z_h W_O[h] -> [d_model]
    const { dh, dm } = L, out = new Float64Array(dm);
    for (let i = 0; i < dh; i++) {
      const o = (h * dh + i) * dm;
      for (let m = 0; m < dm; m++) out[m] += z[i] * L.WO[o + m];
    }
    return out;
  }

  function compute(l, h, t) {
    const L = layerData(l);
    const { scores, weights, sink } = row(L, h, t);
    let top = 0;
    for (let j = 1; j < SEQ; j++) if (weights[j] > weights[top]) top = j;
    const g = kvHead(L, h), q = Array.from(L.q.subarray((t * L.H + h) * L.dh, (t * L.H + h + 1) * L.dh));
    if (L.meta.differential) return { L, scores, weights, sink, top, q, g, ...diffCompute(L, h, t, row) };
    const zs = [];
    for (let hh = 0; hh < L.H; hh++) zs.push(hh === h ? zOf(L, hh, t, weights) : zOf(L, hh, t));
    const concat = new Float64Array(L.H * L.dh);
    zs.forEach((z, hh) => concat.set(z, hh * L.dh));
    const out = new Float64Array(L.dm);
    let contrib = null;
    for (let hh = 0; hh < L.H; hh++) {
      const c = contribution(L, hh, zs[hh]);
      if (hh === h) contrib = c;
      for (let m = 0; m < L.dm; m++) out[m] += c[m];
    }
    if (L.bO) for (let m = 0; m < L.dm; m++) out[m] += L.bO[m];
    return { L, scores, weights, sink, top, z: zs[h], concat, contrib, out, q, g };
  }

  // ------------------------------------------------------------------ canvas grids with hover text
  const tip = $("tip");
  function showTip(ev, text) {
    tip.textContent = text; tip.hidden = false;
    tip.style.left = ev.clientX + 12 + "px"; tip.style.top = ev.clientY + 12 + "px";
  }
  function hideTip() { tip.hidden = true; }

  function hoverable(canvas, textAt, onClick) {
    canvas.addEventListener("mousemove", (ev) => {
      const cell = canvas._grid && cellAt(canvas, ev);
      if (cell) showTip(ev, textAt(cell.r, cell.c)); else hideTip();
    });
    canvas.addEventListener("mouseleave", hideTip);
    if (onClick) canvas.addEventListener("click", (ev) => { const cell = cellAt(canvas, ev); if (cell) onClick(cell.r, cell.c); });
  }

  function cells(container, values, m, prefix) {
    container.replaceChildren();
    values.forEach((x, i) => {
      const d = document.createElement("span");
      const c = diverging(x, m);
      d.className = "cell" + (dark(c) ? " dark" : "");
      d.style.background = css(c);
      d.textContent = fmt(x, 2);
      d.dataset.value = String(x);
      d.title = `${prefix}[${i}] = ${fmt(x, 6)}`;
      container.append(d);
    });
  }

  // ------------------------------------------------------------------ state and selectors
  // The page opens where `headspace explain` starts: its default head and token (DATA.initial), one head shown.
  const INITIAL = DATA.initial || {};
  const inRange = (v, n, fallback) => (Number.isInteger(v) && v >= 0 && v < n ? v : fallback);
  const initialLayer = inRange(INITIAL.layer, N_LAYERS, 0);
  const state = { layer: initialLayer, head: inRange(INITIAL.head, DATA.layers[initialLayer].n_heads, 0),
    token: inRange(INITIAL.token, SEQ, SEQ > 1 ? 1 : 0), shown: null, mode: LONG ? "heatmap" : "lines", matrix: "W_Q",
    result: 0 };

  function radioGroup(container, items, selected, onPick, cls) {
    container.replaceChildren();
    items.forEach((item, i) => {
      const b = document.createElement("button");
      b.type = "button"; b.setAttribute("role", "radio"); b.className = cls;
      b.textContent = item.label; b.dataset.index = String(i);
      if (item.title) b.title = item.title;
      if (item.data) for (const [k, v] of Object.entries(item.data)) b.dataset[k] = v;
      b.setAttribute("aria-checked", String(i === selected));
      b.tabIndex = i === selected ? 0 : -1;
      b.addEventListener("click", () => onPick(i));
      container.append(b);
    });
  }

  // Arrow keys / Home / End move the choice within a radio group (roving tabindex).
  function arrowKeys(container, count, current, onPick) {
    container.addEventListener("keydown", (ev) => {
      const n = count(), i = current();
      let j = null;
      if (ev.key === "ArrowRight" || ev.key === "ArrowDown") j = (i + 1) % n;
      else if (ev.key === "ArrowLeft" || ev.key === "ArrowUp") j = (i - 1 + n) % n;
      else if (ev.key === "Home") j = 0;
      else if (ev.key === "End") j = n - 1;
      if (j === null) return;
      ev.preventDefault(); ev.stopPropagation();
      onPick(j);
      const b = container.querySelector(`[role="radio"][data-index="${j}"]`);
      if (b) b.focus();
    });
  }

  // Only the pipeline's head is shown at first; while it is the one head shown, picking another head or
  // layer moves it along. Once more heads are shown ("all", the toggles), a new layer shows all its heads
  // on short inputs (long ones stay at one: each shown head costs a full seq x seq pattern).
  const single = () => state.shown.size === 1 && state.shown.has(state.head);
  function setLayer(l) {
    const one = single();
    state.layer = (l + N_LAYERS) % N_LAYERS;
    for (const [key, L] of decoded) if (key !== state.layer) L.patterns.clear(); // keep memory bounded
    const H = layerData(state.layer).H;
    if (state.head >= H) state.head = 0;
    state.shown = one || LONG ? new Set([state.head]) : new Set([...Array(H).keys()]);
    buildLayerControls();
    render();
  }
  function setHead(h) {
    const H = layerData(state.layer).H;
    const one = single();
    state.head = (h + H) % H;
    if (one) state.shown = new Set([state.head]); else state.shown.add(state.head);
    buildLayerControls();
    render();
  }
  function setToken(t) { state.token = (t + SEQ) % SEQ; syncTokens(); render(); }

  function buildLayerControls() {
    const L = layerData(state.layer);
    radioGroup($("layer-select"), DATA.layers.map((x, i) => ({ label: "L" + i, title: x.name, data: { layer: String(i) } })),
      state.layer, setLayer, "layer-pick");
    radioGroup($("head-select"), [...Array(L.H).keys()].map((h) => ({ label: "H" + h, data: { head: String(h) } })),
      state.head, setHead, "head-pick");
    const tg = $("head-toggles");
    tg.replaceChildren();
    for (let h = 0; h < L.H; h++) {
      const b = document.createElement("button");
      b.type = "button"; b.className = "head-toggle"; b.textContent = String(h);
      b.dataset.head = String(h); b.title = `show head ${h}`;
      b.style.borderColor = headColor(h, L.H); b.style.background = headColor(h, L.H); b.style.color = "#fff";
      b.setAttribute("aria-pressed", String(state.shown.has(h)));
      b.tabIndex = h === 0 ? 0 : -1;
      b.addEventListener("click", () => {
        if (state.shown.has(h)) state.shown.delete(h); else state.shown.add(h);
        b.setAttribute("aria-pressed", String(state.shown.has(h)));
        renderHeads();
      });
      tg.append(b);
    }
  }

  function syncTokens() {
    for (const b of $("tokens").children) {
      const on = Number(b.dataset.index) === state.token;
      b.setAttribute("aria-checked", String(on)); b.tabIndex = on ? 0 : -1;
    }
  }

  function buildStaticControls() {
    radioGroup($("tokens"), TOKENS.map((t, i) => ({ label: t, title: `token ${i}` })), state.token, setToken, "token");
    arrowKeys($("layer-select"), () => N_LAYERS, () => state.layer, setLayer);
    arrowKeys($("head-select"), () => layerData(state.layer).H, () => state.head, setHead);
    arrowKeys($("tokens"), () => SEQ, () => state.token, setToken);
    // head toggles: arrows move the focus, Space/Enter (native buttons) toggle
    $("head-toggles").addEventListener("keydown", (ev) => {
      const bs = [...$("head-toggles").children], i = bs.indexOf(document.activeElement);
      if (i < 0) return;
      let j = null;
      if (ev.key === "ArrowRight") j = (i + 1) % bs.length;
      else if (ev.key === "ArrowLeft") j = (i - 1 + bs.length) % bs.length;
      if (j === null) return;
      ev.preventDefault(); ev.stopPropagation();
      bs[i].tabIndex = -1; bs[j].tabIndex = 0; bs[j].focus();
    });
    $("show-all").addEventListener("click", () => { state.shown = new Set([...Array(layerData(state.layer).H).keys()]); buildLayerControls(); renderHeads(); });
    $("show-none").addEventListener("click", () => { state.shown = new Set(); buildLayerControls(); renderHeads(); });
    const modes = $("mode-select");
    for (const b of modes.children) b.addEventListener("click", () => { state.mode = b.dataset.mode; renderHeads(); });
    radioGroup($("matrix-select"), ["W_Q", "W_K", "W_V", "W_O"].map((m) => ({ label: m, data: { matrix: m } })), 0,
      (i) => { state.matrix = ["W_Q", "W_K", "W_V", "W_O"][i]; syncMatrix(); renderSubspaces(); }, "matrix-pick");
    arrowKeys($("matrix-select"), () => 4, () => ["W_Q", "W_K", "W_V", "W_O"].indexOf(state.matrix),
      (i) => { state.matrix = ["W_Q", "W_K", "W_V", "W_O"][i]; syncMatrix(); renderSubspaces(); });
    document.addEventListener("keydown", (ev) => {
      if (ev.target.closest && ev.target.closest('[role="radiogroup"], #head-toggles')) return;
      const keys = { "[": () => setLayer(state.layer - 1), "]": () => setLayer(state.layer + 1),
        ",": () => setHead(state.head - 1), ".": () => setHead(state.head + 1),
        h: () => setToken(state.token - 1), l: () => setToken(state.token + 1) };
      if (keys[ev.key] && !ev.ctrlKey && !ev.metaKey && !ev.altKey) { ev.preventDefault(); keys[ev.key](); }
    });
  }

  function syncMatrix() {
    for (const b of $("matrix-select").children) {
      const on = b.dataset.matrix === state.matrix;
      b.setAttribute("aria-checked", String(on)); b.tabIndex = on ? 0 : -1;
    }
  }

  // ------------------------------------------------------------------ view 1: heads
  function renderHeads() {
    const L = layerData(state.layer);
    for (const b of $("mode-select").children) b.setAttribute("aria-checked", String(b.dataset.mode === state.mode));
    const shown = [...state.shown].sort((a, b) => a - b);
    const legendBox = $("heads-legend");
    legendBox.replaceChildren();
    $("lines-view").hidden = state.mode !== "lines";
    $("heatmap-view").hidden = state.mode !== "heatmap";
    if (state.mode === "lines") {
      $("heads-note").textContent = LONG
        ? `each token's ${LINE_TOP_K} most attended tokens per shown head; the selected token's lines are drawn strong`
        : "every weight above 0.02 per shown head; the selected token's lines are drawn strong";
      const wmax = drawLines(L, shown);
      legend(legendBox, "seq", 0, wmax, "line opacity = attention weight");
      const hl = document.createElement("span");
      hl.className = "legend";
      hl.innerHTML = shown.map((h) => `<span class="swatch" style="background:${headColor(h, L.H)}"></span>H${h}`).join(" ");
      legendBox.append(hl);
    } else {
      $("heads-note").textContent = shown.length === 1 ? `pattern of head ${shown[0]} (rows: queries, columns: keys)`
        : `mean pattern over ${shown.length} shown heads (rows: queries, columns: keys)`;
      const max = drawHeatmap(L, shown);
      legend(legendBox, "seq", 0, max, "attention weight");
    }
    $("heads-note").textContent += mechanismNote(L, shown, state.token); // gates, differential pairs
    if (L.meta.sinks) $("heads-note").textContent += `; learned sinks: each row sums to 1 - sink, s_h = ${shown.map((h) => `H${h} ${fmt(L.meta.sinks[h], 3)}`).join(", ")}`;
  }

  function drawLines(L, shown) {
    const left = $("lines-left"), right = $("lines-right"), canvas = $("lines-canvas");
    if (left.childElementCount !== SEQ) {
      left.replaceChildren(); right.replaceChildren();
      TOKENS.forEach((t, i) => {
        for (const col of [left, right]) {
          const d = document.createElement("div");
          d.className = "lt"; d.textContent = t; d.dataset.index = String(i);
          d.addEventListener("click", () => setToken(i));
          col.append(d);
        }
      });
    }
    for (const col of [left, right]) for (const d of col.children) d.classList.toggle("sel", Number(d.dataset.index) === state.token);
    const RH = 20, W = 260;
    canvas.width = W; canvas.height = SEQ * RH;
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, W, canvas.height);
    // edges: every weight >= 0.02 (short inputs) or each row's LINE_TOP_K largest (long inputs)
    const edges = [];
    let wmax = 0;
    for (const h of shown) {
      const p = pattern(L, h), color = headColor(h, L.H);
      for (let t = 0; t < SEQ; t++) {
        const r = p.subarray(t * SEQ, (t + 1) * SEQ);
        const js = LONG ? topK(r, LINE_TOP_K) : [...Array(SEQ).keys()].filter((j) => r[j] >= 0.02);
        for (const j of js) { edges.push([t, j, r[j], color]); if (r[j] > wmax) wmax = r[j]; }
      }
    }
    for (const strongPass of [false, true]) {
      for (const [t, j, w, color] of edges) {
        const strong = t === state.token;
        if (strong !== strongPass) continue;
        const a = wmax > 0 ? w / wmax : 0; // opacity: weight relative to the largest drawn
        ctx.globalAlpha = strong ? Math.max(0.08, a) : 0.25 * a;
        ctx.strokeStyle = color; ctx.lineWidth = strong ? 1 + 3 * a : 1;
        ctx.beginPath(); ctx.moveTo(2, t * RH + RH / 2); ctx.lineTo(W - 2, j * RH + RH / 2); ctx.stroke();
      }
    }
    ctx.globalAlpha = 1;
    const view = $("lines-view"), y = state.token * RH; // keep the selected token in sight
    if (y < view.scrollTop || y > view.scrollTop + view.clientHeight - RH) view.scrollTop = Math.max(0, y - view.clientHeight / 2);
    return wmax;
  }

  function drawHeatmap(L, shown) {
    const canvas = $("heatmap-canvas");
    const mean = new Float32Array(SEQ * SEQ);
    for (const h of shown) { const p = pattern(L, h); for (let i = 0; i < p.length; i++) mean[i] += p[i] / shown.length; }
    let max = 0;
    for (const x of mean) if (x > max) max = x;
    const cell = Math.max(1, Math.min(36, Math.floor(560 / SEQ)));
    const labels = SEQ <= 48;
    const ctx = paintGrid(canvas, SEQ, SEQ, (r, c) => sequential(mean[r * SEQ + c], 0, max),
      { cw: cell, ch: cell, ox: labels ? 90 : 0, oy: labels ? 70 : 0, rowLabels: labels ? TOKENS : null, colLabels: labels ? TOKENS : null });
    outline(ctx, canvas, state.token, 0, 1, SEQ, "#e8710a");
    canvas._hover = (r, c) => `${TOKENS[r]} (${r}) -> ${TOKENS[c]} (${c}): ${fmt(mean[r * SEQ + c], 4)}`;
    return max;
  }

  // ------------------------------------------------------------------ view 2: the pipeline
  let last = null;
  function renderPipeline() {
    const l = state.layer, h = state.head, t = state.token;
    const r = compute(l, h, t);
    last = { layer: l, head: h, token: t, ...r };
    const L = r.L;
    $("pipeline-title").textContent = `layer ${l} (${L.meta.name}), head ${h}` + (L.Hkv !== L.H ? ` (reads k/v head ${r.g})` : "") +
      `, token ${t} "${TOKENS[t]}"; d_head = ${L.dh}, d_model = ${L.dm}; ${DATA.precision === "float16" ? "values stored as float16 (about 3 significant digits)" : "float32 values, as traced"}`;
    const top = $("top-token");
    top.textContent = TOKENS[r.top]; top.dataset.index = String(r.top);
    $("top-weight").textContent = fmt(r.weights[r.top], 4);

    const qm = maxAbs(r.q);
    cells($("q-cells"), r.q, qm, "q");
    $("q-legend").replaceChildren(); legend($("q-legend"), "div", -qm, qm, "q");

    // k and v of every token, this head's columns
    let km = 0;
    for (let j = 0; j < SEQ; j++) for (let i = 0; i < L.dh; i++) {
      const o = (j * L.Hkv + r.g) * L.dh + i;
      km = Math.max(km, Math.abs(L.k[o]), Math.abs(L.v[o]));
    }
    const ch = LONG ? Math.max(1, Math.floor(640 / SEQ)) : 14;
    const labels = LONG ? null : TOKENS;
    for (const [id, arr, name] of [["k-canvas", L.k, "k"], ["v-canvas", L.v, "v"]]) {
      const canvas = $(id);
      const ctx = paintGrid(canvas, SEQ, L.dh, (j, i) => diverging(arr[(j * L.Hkv + r.g) * L.dh + i], km),
        { cw: 8, ch, ox: labels ? 84 : 0, rowLabels: labels });
      outline(ctx, canvas, name === "k" ? t : r.top, 0, 1, L.dh, name === "k" ? "#e8710a" : "#1d1d1f");
      canvas._hover = (j, i) => `${name} of ${TOKENS[j]} (${j}), [${i}] = ${fmt(arr[(j * L.Hkv + r.g) * L.dh + i], 6)}`;
    }
    $("kv-legend").replaceChildren(); legend($("kv-legend"), "div", -km, km, "k, v");
    const marks = document.createElement("span");
    marks.innerHTML = '<span class="swatch" style="border:2px solid #e8710a"></span>the selected token\'s k ' +
      '<span class="swatch" style="border:2px solid #1d1d1f"></span>the top attended token\'s v';
    $("kv-legend").append(marks);

    $("scores-note").textContent = `scale = ${fmt(L.meta.scale, 6)}, mask: ${L.meta.mask}${L.meta.window ? " " + L.meta.window : ""}` +
      (L.meta.alibi ? `, ALiBi slope ${fmt(L.meta.alibi[h], 6)}` : "") +
      (L.meta.sinks ? `; learned sink s_h = ${fmt(L.meta.sinks[h], 4)} takes ${fmt(r.sink, 4)} of this row: ` +
        `the key weights sum to 1 - sink = ${fmt(1 - r.sink, 4)}` : "") +
      (SEQ > TABLE_ROWS ? `; the ${TABLE_ROWS} largest weights of ${SEQ}, largest first` : "; every token, in order");
    const order = SEQ > TABLE_ROWS ? [...Array(SEQ).keys()].sort((a, b) => r.weights[b] - r.weights[a]).slice(0, TABLE_ROWS) : [...Array(SEQ).keys()];
    const body = $("scores-table").tBodies[0];
    body.replaceChildren();
    for (const j of order) {
      const tr = document.createElement("tr");
      tr.dataset.index = String(j);
      if (j === r.top) tr.className = "top";
      const masked = r.scores[j] === -Infinity;
      tr.innerHTML = `<td>${j}</td><td class="tok"></td><td class="score"></td><td class="weight"></td><td class="bar-col"><div class="bar"></div></td>`;
      tr.children[1].textContent = TOKENS[j];
      tr.children[2].textContent = masked ? "masked" : fmt(r.scores[j], 4);
      tr.children[2].dataset.value = String(r.scores[j]);
      tr.children[3].textContent = fmt(r.weights[j], 4);
      tr.children[3].dataset.value = String(r.weights[j]);
      tr.querySelector(".bar").style.width = Math.round(140 * r.weights[j]) + "px";
      body.append(tr);
    }

    const zm = maxAbs(r.z);
    cells($("z-cells"), r.z, zm, "z");
    $("z-legend").replaceChildren(); legend($("z-legend"), "div", -zm, zm, "z");
    mechanismView($("z-legend"), L, h, t, r, TOKENS, row); // the gate, the pair's difference row

    const cm = maxAbs(r.concat);
    const cc = $("concat-canvas");
    const cctx = paintGrid(cc, 1, L.H * L.dh, (_, i) => diverging(r.concat[i], cm), { cw: 2, ch: 18 });
    const [o0, nr] = r.diff ? [r.pair * 2 * L.dh, 2 * L.dh] : [h * L.dh, L.dh]; // a pair: W_O rows of heads 2j, 2j + 1
    outline(cctx, cc, 0, o0, 1, nr, "#e8710a");
    cc._hover = (_, i) => `head ${Math.floor(i / L.dh)}, z[${i % L.dh}] = ${fmt(r.concat[i], 6)}`;
    $("concat-legend").replaceChildren(); legend($("concat-legend"), "div", -cm, cm, `concat (this ${r.diff ? "pair" : "head"} outlined)`);

    let wm = 0;
    for (let i = 0; i < nr * L.dm; i++) wm = Math.max(wm, Math.abs(L.WO[o0 * L.dm + i]));
    const wc = $("wo-canvas");
    paintGrid(wc, nr, L.dm, (i, m) => diverging(L.WO[(o0 + i) * L.dm + m], wm), { cw: 2, ch: 5 });
    wc._hover = (i, m) => `W_O[${Math.floor((o0 + i) / L.dh)}][${(o0 + i) % L.dh}, ${m}] = ${fmt(L.WO[(o0 + i) * L.dm + m], 6)}`;
    $("wo-legend").replaceChildren(); legend($("wo-legend"), "div", -wm, wm, r.diff ? `W_O[${2 * r.pair}], W_O[${2 * r.pair + 1}]` : "W_O[h]");

    for (const [id, arr, name, legendId] of [["contrib-canvas", r.contrib, "z_h W_O[h]", "contrib-legend"], ["out-canvas", r.out, "out", "out-legend"]]) {
      const c = $(id), m = maxAbs(arr);
      paintGrid(c, 1, L.dm, (_, i) => diverging(arr[i], m), { cw: 2, ch: 18 });
      c._hover = (_, i) => `${name}[${i}] = ${fmt(arr[i], 6)}`;
      $(legendId).replaceChildren(); legend($(legendId), "div", -m, m, name);
    }
    const topDims = [...Array(L.dm).keys()].sort((a, b) => Math.abs(r.out[b]) - Math.abs(r.out[a])).slice(0, 5);
    const share = L.shares[t * L.H + h];
    $("out-top").innerHTML = "";
    $("out-top").append(`largest |out| dimensions: ` + topDims.map((m) => `out[${m}] = ${fmt(r.out[m], 4)}`).join(", ") +
      `; this head's share of the token's output: ${fmt(share, 4)}`);
  }

  // ------------------------------------------------------------------ view 3: subspaces
  function renderSubspaces() {
    const L = layerData(state.layer);
    const M = L.overlap[state.matrix];
    const n = M.shape[0];
    const canvas = $("overlap-canvas");
    const names = [...Array(n).keys()].map((i) => (state.matrix === "W_K" || state.matrix === "W_V") && L.Hkv !== L.H ? "kv" + i : "H" + i);
    const ctx = paintGrid(canvas, n, n, (a, b) => sequential(M.v[a * n + b], 0, 1), { cw: 32, ch: 22, ox: 40, oy: 34, rowLabels: names, colLabels: names });
    ctx.textAlign = "center"; ctx.font = "10px ui-monospace, monospace";
    for (let a = 0; a < n; a++) for (let b = 0; b < n; b++) {
      const v = M.v[a * n + b];
      ctx.fillStyle = dark(sequential(v, 0, 1)) ? "#fff" : "#1d1d1f";
      ctx.fillText(fmt(v, 2), 40 + b * 32 + 16, 34 + a * 22 + 11);
    }
    const focus = (state.matrix === "W_K" || state.matrix === "W_V") ? kvHead(L, state.head) : state.head;
    outline(ctx, canvas, focus, 0, 1, n, "#e8710a");
    canvas._hover = (a, b) => `${state.matrix}: ${names[a]} vs ${names[b]} overlap ${fmt(M.v[a * n + b], 4)}`;
    const base = L.meta.overlap_baseline;
    $("overlap-note").textContent = `${state.matrix} of layer ${state.layer}: mean squared cosine of the principal angles between two heads' ` +
      `subspaces (1 = same subspace, 0 = orthogonal). Random ${L.dh}-dim subspaces of R^${L.dm} give ${fmt(base, 4)} on average.`;
    $("overlap-legend").replaceChildren();
    legend($("overlap-legend"), "seq", 0, 1, "overlap", { value: base, label: `| = random baseline ${fmt(base, 3)}` });
  }

  // ------------------------------------------------------------------ view 4: W_O's weighing of heads
  function renderMixing() {
    const L = layerData(state.layer);
    let sm = 0;
    for (const x of L.shares) sm = Math.max(sm, x);
    const canvas = $("shares-canvas");
    const ch = LONG ? 3 : 18;
    const ctx = paintGrid(canvas, SEQ, L.H, (t, h) => sequential(L.shares[t * L.H + h], 0, sm),
      { cw: 28, ch, ox: LONG ? 0 : 90, oy: 30, rowLabels: LONG ? null : TOKENS, colLabels: [...Array(L.H).keys()].map((h) => "H" + h) });
    if (!LONG) {
      ctx.textAlign = "center"; ctx.font = "10px ui-monospace, monospace";
      for (let t = 0; t < SEQ; t++) for (let h = 0; h < L.H; h++) {
        const v = L.shares[t * L.H + h];
        ctx.fillStyle = dark(sequential(v, 0, sm)) ? "#fff" : "#1d1d1f";
        ctx.fillText(fmt(v, 2), 90 + h * 28 + 14, 30 + t * ch + ch / 2);
      }
    }
    outline(ctx, canvas, state.token, 0, 1, L.H, "#e8710a");
    outline(ctx, canvas, 0, state.head, SEQ, 1, "#1d1d1f");
    canvas._hover = (t, h) => `${TOKENS[t]} (${t}), head ${h}: share ${fmt(L.shares[t * L.H + h], 4)}`;
    $("shares-legend").replaceChildren(); legend($("shares-legend"), "seq", 0, sm, "share of the output");

    const norms = L.meta.wo_norms, nm = Math.max(...norms);
    const nc = $("wo-norms-canvas");
    const nctx = paintGrid(nc, 1, L.H, (_, h) => sequential(norms[h], 0, nm), { cw: 60, ch: 22, oy: 0 });
    nctx.textAlign = "center"; nctx.font = "10px ui-monospace, monospace";
    norms.forEach((v, h) => { nctx.fillStyle = dark(sequential(v, 0, nm)) ? "#fff" : "#1d1d1f"; nctx.fillText(`H${h} ${fmt(v, 2)}`, h * 60 + 30, 11); });
    nc._hover = (_, h) => `||W_O[${h}]||_F = ${fmt(norms[h], 4)}`;
    $("wo-norms-legend").replaceChildren(); legend($("wo-norms-legend"), "seq", 0, nm, "||W_O[h]||_F");
  }

  // ------------------------------------------------------------------ view 5: saved results
  // Each view (headspace/viz/explorer/results.py): rows x cols values (null = no value), a diverging
  // (centred on 0) or sequential (0..1) scale with its unit, facts, the largest cells, and `link`: what a
  // click on a cell selects in the other views.
  const RESULTS = Array.isArray(DATA.results) ? DATA.results : [];
  const GREY = [225, 225, 228];

  function resultRange(V) {
    let m = 0, hi = 0;
    for (const row of V.values) for (const v of row) if (v !== null) { m = Math.max(m, Math.abs(v)); hi = Math.max(hi, v); }
    return V.scale === "diverging" ? { lo: -m, hi: m, color: (v) => (v === null ? GREY : diverging(v, m)) }
      : { lo: 0, hi: hi > 0 ? hi : 1, color: (v) => (v === null ? GREY : sequential(v, 0, hi > 0 ? hi : 1)) };
  }

  // The layer (and head) a cell stands for, or null: {layer, head}, head null for a layer-wide part.
  function resultTarget(V, r, c) {
    let t = null;
    if (V.link === "layer_head") t = { layer: r, head: c < (V.n_heads || 0) ? c : null };
    else if (V.link === "layer_head_rows") t = { layer: Math.floor(r / V.n_heads), head: r % V.n_heads };
    else if (V.link === "layer") t = { layer: r, head: null };
    else if (V.link === "lens") t = r > 0 ? { layer: r - 1, head: null } : null;
    if (!t || t.layer >= N_LAYERS || (t.head !== null && t.head >= DATA.layers[t.layer].n_heads)) return null;
    return t;
  }

  function resultHover(V, r, c) {
    const v = V.values[r][c];
    const col = V.col_axis === "position" ? `position ${c} ${JSON.stringify(V.cols[c])}` : V.cols[c];
    let text = `${V.rows[r]}, ${col}: ${v === null ? "no value" : fmt(v, 4)}`;
    if (V.notes && V.notes[r] && V.notes[r][c]) text += "\n" + V.notes[r][c];
    return text;
  }

  function setResult(i) {
    state.result = (i + RESULTS.length) % RESULTS.length;
    for (const b of $("result-select").children) {
      const on = Number(b.dataset.index) === state.result;
      b.setAttribute("aria-checked", String(on)); b.tabIndex = on ? 0 : -1;
    }
    renderResults();
  }

  function renderResults() {
    if (!RESULTS.length) return;
    const V = RESULTS[state.result];
    $("result-title").textContent = V.title;
    const rows = V.rows.length, cols = V.cols.length;
    const range = resultRange(V);
    const cw = cols <= 16 ? 46 : Math.max(8, Math.min(32, Math.floor(960 / cols)));
    const ch = rows <= 64 ? 18 : 12;
    const longest = (labels) => Math.min(12, Math.max(1, ...labels.map((x) => String(x).length)));
    const ox = 12 + 7 * longest(V.rows), oy = 10 + 7 * longest(V.cols);
    const canvas = $("result-canvas");
    const ctx = paintGrid(canvas, rows, cols, (r, c) => range.color(V.values[r][c]),
      { cw, ch, ox, oy, rowLabels: V.rows.map(String), colLabels: V.cols.map(String) });
    if (cw >= 40 && ch >= 16) { // room for the numbers themselves
      ctx.textAlign = "center"; ctx.font = "10px ui-monospace, monospace";
      for (let r = 0; r < rows; r++) for (let c = 0; c < cols; c++) {
        const v = V.values[r][c];
        if (v === null) continue;
        ctx.fillStyle = dark(range.color(v)) ? "#fff" : "#1d1d1f";
        ctx.fillText(fmt(v, 2).replace(/^-(0\.00)$/, "$1"), ox + c * cw + cw / 2, oy + r * ch + ch / 2);
      }
    }
    // the layer (and head) the other views show, outlined
    if (V.link === "layer_head" && state.layer < rows && state.head < cols) outline(ctx, canvas, state.layer, state.head, 1, 1, "#e8710a");
    else if (V.link === "layer_head_rows") { const r = state.layer * V.n_heads + state.head; if (r < rows) outline(ctx, canvas, r, 0, 1, cols, "#e8710a"); }
    else if (V.link === "layer" && state.layer < rows) outline(ctx, canvas, state.layer, 0, 1, cols, "#e8710a");
    else if (V.link === "lens" && state.layer + 1 < rows) outline(ctx, canvas, state.layer + 1, 0, 1, cols, "#e8710a");
    canvas._hover = (r, c) => resultHover(V, r, c);
    $("result-legend").replaceChildren();
    legend($("result-legend"), V.scale === "diverging" ? "div" : "seq", range.lo, range.hi, V.unit);
    const grey = document.createElement("span");
    grey.innerHTML = '<span class="swatch" style="background:rgb(225,225,228)"></span>no value';
    $("result-legend").append(grey);
    $("result-hint").textContent = "Hover a cell for its value" +
      (V.link ? "; click one to follow its layer" + (V.link.startsWith("layer_head") ? " and head" : "") + " in the views below." : ".");
    const facts = $("result-facts").tBodies[0];
    facts.replaceChildren();
    for (const [label, text] of V.facts) {
      const tr = document.createElement("tr");
      const th = document.createElement("th"); th.textContent = label;
      const td = document.createElement("td"); td.textContent = text;
      tr.append(th, td); facts.append(tr);
    }
    const top = $("result-top").tBodies[0];
    top.replaceChildren();
    for (const [label, v] of V.top) {
      const tr = document.createElement("tr");
      const a = document.createElement("td"); a.className = "tok"; a.textContent = label;
      const b = document.createElement("td"); b.className = "value"; b.textContent = fmt(v, 4); b.dataset.value = String(v);
      tr.append(a, b); top.append(tr);
    }
  }

  function render() {
    renderHeads();
    renderPipeline();
    renderSubspaces();
    renderMixing();
    renderResults();
  }

  // ------------------------------------------------------------------ start
  function start() {
    const t0 = performance.now();
    $("subtitle").textContent = `${DATA.model ? DATA.model + " — " : ""}${SEQ} tokens, ${N_LAYERS} attention layers` +
      (DATA.sentence ? `: "${DATA.sentence.length > 160 ? DATA.sentence.slice(0, 160) + "…" : DATA.sentence}"` : "");
    const grid = DATA.layers.some((L) => L.W_O.dtype === "grid4") ? " (W_O from its exact 4-bit codes)" : "";
    $("footer").textContent = `${DATA.format}; ${DATA.precision} values${grid}; written by headspace. Scores, softmax, z and out ` +
      "are computed in this page from the traced q, k, v and the model's W_O, b_O." +
      (RESULTS.length ? ` The ${RESULTS.length} saved result view(s) are drawn as saved.` : "");
    state.shown = new Set([state.head]);
    buildStaticControls();
    buildLayerControls();
    syncTokens(); syncMatrix();
    for (const id of ["heatmap-canvas", "k-canvas", "v-canvas", "concat-canvas", "wo-canvas", "contrib-canvas",
      "out-canvas", "overlap-canvas", "shares-canvas", "wo-norms-canvas"]) {
      const c = $(id);
      hoverable(c, (r, col) => (c._hover ? c._hover(r, col) : ""), id === "heatmap-canvas" || id === "shares-canvas" ? (r) => setToken(r) : null);
    }
    if (RESULTS.length) {
      $("view-results").hidden = false;
      radioGroup($("result-select"), RESULTS.map((v, i) => ({ label: v.name, title: v.title, data: { result: String(i) } })),
        state.result, setResult, "result-pick");
      arrowKeys($("result-select"), () => RESULTS.length, () => state.result, setResult);
      const rc = $("result-canvas");
      hoverable(rc, (r, c) => (rc._hover ? rc._hover(r, c) : ""), (r, c) => {
        const t = resultTarget(RESULTS[state.result], r, c);
        if (t) window.headspaceExplorer.select(t.head === null ? { layer: t.layer } : { layer: t.layer, head: t.head });
      });
    }
    $("overlap-canvas").addEventListener("click", (ev) => {
      const cell = cellAt($("overlap-canvas"), ev);
      if (cell && state.matrix !== "W_K" && state.matrix !== "W_V") setHead(cell.r);
    });
    render();
    document.body.dataset.ready = "true";
    document.body.dataset.renderMs = String(Math.round(performance.now() - t0)); // drawing, after parsing
    document.body.dataset.readyMs = String(Math.round(performance.now())); // since navigation start
  }

  // What the page shows, for tests and the console: the numbers of the current pipeline.
  window.headspaceExplorer = {
    state,
    select(o) { if (o.layer !== undefined) setLayer(o.layer); if (o.head !== undefined) setHead(o.head); if (o.token !== undefined) setToken(o.token); },
    // view 5: pick a saved result; what it draws (the numbers as embedded)
    selectResult(i) { setResult(i); },
    result() {
      if (!RESULTS.length) return null;
      const V = RESULTS[state.result], g = $("result-canvas")._grid;
      return { index: state.result, name: V.name, rows: V.rows, cols: V.cols, values: V.values, grid: g,
        canvas: [$("result-canvas").width, $("result-canvas").height] };
    },
    snapshot() {
      const r = last;
      return { layer: r.layer, head: r.head, token: r.token, top: r.top, topToken: TOKENS[r.top],
        scores: Array.from(r.scores, (x) => (x === -Infinity ? null : x)), weights: Array.from(r.weights), q: r.q,
        sink: r.sink, gate: r.L.gate ? Array.from(gateOf(r.L, r.head, r.token)) : null, diff: r.diff ? Array.from(r.diff) : null, scoresNote: $("scores-note").textContent,
        z: Array.from(r.z), concat: Array.from(r.concat), contrib: Array.from(r.contrib), out: Array.from(r.out) };
    },
  };
  start();
})();
