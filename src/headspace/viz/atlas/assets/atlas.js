// The atlas page: a layer x head grid coloured by one statistic; a click shows a head's numbers,
// its relation in words and its top examples. Every text goes in through textContent (no HTML parsing
// of data), and the page makes no request.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("atlas-data").textContent);
  const stats = data.stat_names;
  const state = { stat: data.default_stat, layer: null, head: null };

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function fmt(v) {
    if (v === null || v === undefined) return "n/a";
    const a = Math.abs(v);
    return a !== 0 && (a < 1e-3 || a >= 1e4) ? v.toExponential(2) : v.toFixed(3);
  }

  function range(name) {
    let lo = Infinity, hi = -Infinity;
    for (const row of data.stats[name]) for (const v of row) if (v !== null) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    return lo === Infinity ? [0, 0] : [lo, hi];
  }

  function colour(v, lo, hi, signed) {
    if (v === null) return "#eee";
    if (signed) {
      const m = Math.max(Math.abs(lo), Math.abs(hi)) || 1;
      const t = Math.min(1, Math.abs(v) / m);
      const c = Math.round(255 * (1 - t));
      return v >= 0 ? `rgb(255,${c},${c})` : `rgb(${c},${c},255)`;
    }
    const t = hi > lo ? (v - lo) / (hi - lo) : 0;
    const c = Math.round(255 * (1 - t));
    return `rgb(${c},${Math.round(255 - 120 * t)},255)`;
  }

  function drawGrid() {
    const grid = document.getElementById("grid");
    grid.replaceChildren();
    const [lo, hi] = range(state.stat);
    const signed = data.signed.includes(state.stat);
    document.getElementById("range").textContent = ` ${fmt(lo)} .. ${fmt(hi)}`;
    const head = el("tr");
    head.appendChild(el("th", {}, "layer \\ head"));
    for (let h = 0; h < data.max_heads; h++) head.appendChild(el("th", {}, String(h)));
    grid.appendChild(head);
    data.n_heads.forEach((n, layer) => {
      const tr = el("tr");
      tr.appendChild(el("th", {}, String(layer)));
      for (let h = 0; h < data.max_heads; h++) {
        const td = el("td", { class: "cell", "data-layer": layer, "data-head": h });
        if (h >= n) { td.classList.add("absent"); tr.appendChild(td); continue; }
        const v = data.stats[state.stat][layer][h];
        td.style.background = colour(v, lo, hi, signed);
        td.title = `layer ${layer} head ${h}: ${state.stat} ${fmt(v)}`;
        td.setAttribute("aria-selected", String(layer === state.layer && h === state.head));
        td.addEventListener("click", () => select(layer, h));
        tr.appendChild(td);
      }
      grid.appendChild(tr);
    });
  }

  function snippet(ctx, cls) {
    const span = el("span");
    ctx.tokens.forEach((t, i) => span.appendChild(el("span", { class: i === ctx.at ? `tok ${cls}` : "tok" }, t)));
    return span;
  }

  function exampleLine(ex) {
    const div = el("div", { class: "example" });
    div.appendChild(el("span", {}, `${ex.document} q${ex.query} k${ex.key} (${fmt(ex.value)}): `));
    div.appendChild(snippet(ex.key_context, "key"));
    div.appendChild(el("span", {}, "  \u2192  "));
    div.appendChild(snippet(ex.query_context, "query"));
    return div;
  }

  function select(layer, head) {
    state.layer = layer; state.head = head;
    const box = document.getElementById("detail");
    box.replaceChildren();
    box.appendChild(el("h2", {}, `Layer ${layer}, head ${head}`));
    const words = data.relations[layer][head];
    box.appendChild(el("p", { class: "relation", id: "relation" }, words.length ? words.join("; ") : "no single relation stands out"));
    const table = el("table", { id: "head-stats" });
    for (const name of stats) {
      const tr = el("tr");
      tr.appendChild(el("th", {}, name));
      tr.appendChild(el("td", { "data-stat": name }, fmt(data.stats[name][layer][head])));
      table.appendChild(tr);
    }
    box.appendChild(table);
    for (const [kind, title] of [["attention", "Top examples by attention weight"], ["direct_effect", "Top examples by |direct effect|"]]) {
      box.appendChild(el("h3", {}, title));
      const list = el("div", { class: "examples", "data-kind": kind });
      for (const ex of data.examples[layer][head][kind]) list.appendChild(exampleLine(ex));
      box.appendChild(list);
    }
    drawGrid();
  }

  const pick = document.getElementById("stat");
  for (const name of stats) pick.appendChild(el("option", { value: name }, name));
  pick.value = state.stat;
  pick.addEventListener("change", () => { state.stat = pick.value; drawGrid(); });
  document.getElementById("subtitle").textContent = data.subtitle;
  drawGrid();
  window.headspaceAtlas = { select, state, data };
  document.body.dataset.ready = "true";
})();
