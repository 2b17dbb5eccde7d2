// headspace explorer: the page's pure helpers, before explorer.js in the same script (page.py joins them):
// decoding the stored arrays (base64 float32/float16, "grid4" codes, the deflated block), colours and
// legends, canvas grids, top-k. Nothing here reads the page's data; explorer.js passes what they need.

// ------------------------------------------------------------------ decoding the stored arrays
const F16 = (() => {
  const t = new Float32Array(65536);
  for (let i = 0; i < 65536; i++) {
    const s = i >> 15, e = (i >> 10) & 31, f = i & 1023;
    let v;
    if (e === 0) v = f * Math.pow(2, -24);
    else if (e === 31) v = f ? NaN : Infinity;
    else v = (1 + f / 1024) * Math.pow(2, e - 15);
    t[i] = s ? -v : v;
  }
  return t;
})();

// windows-1252 reads bytes 0x80..0x9F as these characters (a page opened from its file); a page given as
// text (Jupyter's srcdoc) has the characters U+0080..U+009F themselves.
function blockBytes(text) {
  const high = "\u20ac\u0081\u201a\u0192\u201e\u2026\u2020\u2021\u02c6\u2030\u0160\u2039\u0152\u008d\u017d\u008f" +
    "\u0090\u2018\u2019\u201c\u201d\u2022\u2013\u2014\u02dc\u2122\u0161\u203a\u0153\u009d\u017e\u0178";
  const map = new Map([...high].map((c, i) => [c.charCodeAt(0), 0x80 + i]));
  const out = new Uint8Array(text.length);
  let n = 0;
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i);
    const b = c > 0xff ? map.get(c) : c;
    if (b === 0x7e) out[n++] = (((c2) => (c2 > 0xff ? map.get(c2) : c2))(text.charCodeAt(++i)) - 64) & 255;
    else out[n++] = b;
  }
  return out.subarray(0, n);
}

async function inflateBlock(text, n) { // the page's deflated block -> its n bytes
  const stream = new Blob([blockBytes(text)]).stream().pipeThrough(new DecompressionStream("deflate"));
  const bytes = new Uint8Array(await new Response(stream).arrayBuffer());
  if (bytes.length !== n) throw new Error(`the page's block holds ${bytes.length} bytes, not ${n}`);
  return bytes;
}

function bytesOf(text, blob) {
  if (typeof text !== "string") return blob.slice(text.at, text.at + text.n); // {at, n} into the block
  const bin = atob(text);
  const bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return bytes;
}

function floats(text, dtype, blob) { // base64 of little-endian float32 or float16 -> Float32Array
  const bytes = bytesOf(text, blob);
  if (dtype === "float32") return new Float32Array(bytes.buffer);
  const half = new Uint16Array(bytes.buffer);
  const out = new Float32Array(half.length);
  for (let i = 0; i < half.length; i++) out[i] = F16[half[i]];
  return out;
}

// "grid4" (data.py / codec.py): W_O [H, dh, dm] as 4-bit codes, per block of 32 a lo and a step, in the
// order of W_O transposed [dm, H * dh]; each weight is fl32(fl32(step * code) + lo), the float32 bits
// Python checked. (A float32 product of float32 numbers is exact in a double, so fround gives the float32 one.)
function decodeGrid(a, blob) {
  const [H, dh, dm] = a.shape, width = H * dh, block = a.block;
  const lo = floats(a.lo, a.scale_dtype, blob), step = floats(a.step, a.scale_dtype, blob), codes = bytesOf(a.codes, blob);
  const out = new Float32Array(H * dh * dm);
  for (let m = 0; m < dm; m++) {
    for (let j = 0; j < width; j++) {
      const n = m * width + j, b = (n / block) | 0;
      const code = n & 1 ? codes[n >> 1] >> 4 : codes[n >> 1] & 15;
      out[j * dm + m] = Math.fround(Math.fround(step[b] * code) + lo[b]);
    }
  }
  return out;
}

function decodeArray(a, blob) { // a stored array (floats or "grid4"; blob: the page's block or null)
  if (a === null) return null;
  if (a.dtype === "grid4") return decodeGrid(a, blob);
  return floats(a.data, a.dtype, blob);
}

// ------------------------------------------------------------------ colours and legends
const PURPLE = [75, 41, 145], RED = [178, 24, 43], BLUE = [33, 102, 172];
function mix(c, a) { return [255 + (c[0] - 255) * a, 255 + (c[1] - 255) * a, 255 + (c[2] - 255) * a]; }
function diverging(v, m) { const t = m > 0 ? Math.max(-1, Math.min(1, v / m)) : 0; return mix(t >= 0 ? RED : BLUE, Math.abs(t)); }
function sequential(v, lo, hi) { const t = hi > lo ? Math.max(0, Math.min(1, (v - lo) / (hi - lo))) : 0; return mix(PURPLE, t); }
function css(c) { return `rgb(${c[0] | 0},${c[1] | 0},${c[2] | 0})`; }
function dark(c) { return c[0] * 0.299 + c[1] * 0.587 + c[2] * 0.114 < 140; }
function headColor(h, H) { return `hsl(${Math.round((h * 360) / H)}, 70%, 42%)`; }
function maxAbs(arr) { let m = 0; for (const x of arr) if (Math.abs(x) > m) m = Math.abs(x); return m; }
function fmt(x, d) { return Number(x).toFixed(d); }

// A colour bar with its range; kind "div" (blue - white - red around 0) or "seq" (white - purple).
function legend(container, kind, lo, hi, label, marker) {
  const box = document.createElement("span");
  box.className = "legend";
  const c = document.createElement("canvas");
  c.width = 150; c.height = 12;
  const ctx = c.getContext("2d");
  for (let x = 0; x < 150; x++) {
    const v = lo + ((hi - lo) * x) / 149;
    ctx.fillStyle = css(kind === "div" ? diverging(v, Math.max(Math.abs(lo), Math.abs(hi))) : sequential(v, lo, hi));
    ctx.fillRect(x, 0, 1, 12);
  }
  if (marker !== undefined && hi > lo) {
    const x = Math.round(((marker.value - lo) / (hi - lo)) * 149);
    ctx.fillStyle = "#000"; ctx.fillRect(Math.max(0, x - 1), 0, 2, 12);
  }
  const l = document.createElement("span"); l.textContent = label + ":";
  const a = document.createElement("span"); a.textContent = fmt(lo, 3);
  const b = document.createElement("span"); b.textContent = fmt(hi, 3);
  box.append(l, a, c, b);
  if (marker !== undefined) { const m = document.createElement("span"); m.textContent = marker.label; box.append(m); }
  container.append(box);
}

// Paint rows x cols cells of cw x ch pixels at offset (ox, oy); colorAt(r, c) -> [r, g, b].
function paintGrid(canvas, rows, cols, colorAt, o) {
  const cw = o.cw, ch = o.ch, ox = o.ox || 0, oy = o.oy || 0;
  canvas.width = ox + cols * cw; canvas.height = oy + rows * ch;
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, canvas.width, canvas.height);
  const img = ctx.createImageData(cols * cw, rows * ch);
  const W = cols * cw;
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < cols; c++) {
      const col = colorAt(r, c);
      for (let y = r * ch; y < (r + 1) * ch; y++) {
        let p = (y * W + c * cw) * 4;
        for (let x = 0; x < cw; x++, p += 4) { img.data[p] = col[0]; img.data[p + 1] = col[1]; img.data[p + 2] = col[2]; img.data[p + 3] = 255; }
      }
    }
  }
  ctx.putImageData(img, ox, oy);
  ctx.font = "11px ui-monospace, monospace"; ctx.fillStyle = "#1d1d1f"; ctx.textBaseline = "middle";
  if (o.rowLabels) {
    ctx.textAlign = "right";
    for (let r = 0; r < rows; r++) ctx.fillText(o.rowLabels[r].slice(0, 12), ox - 4, oy + r * ch + ch / 2);
  }
  if (o.colLabels) {
    ctx.save(); ctx.textAlign = "left";
    for (let c = 0; c < cols; c++) {
      ctx.save(); ctx.translate(ox + c * cw + cw / 2, oy - 4); ctx.rotate(-Math.PI / 2);
      ctx.fillText(o.colLabels[c].slice(0, 12), 0, 0); ctx.restore();
    }
    ctx.restore();
  }
  canvas._grid = { rows, cols, cw, ch, ox, oy };
  return ctx;
}

function outline(ctx, canvas, r0, c0, nr, nc, color) {
  const g = canvas._grid;
  ctx.strokeStyle = color; ctx.lineWidth = 2;
  ctx.strokeRect(g.ox + c0 * g.cw + 1, g.oy + r0 * g.ch + 1, nc * g.cw - 2, nr * g.ch - 2);
}

function cellAt(canvas, ev) {
  const g = canvas._grid, rect = canvas.getBoundingClientRect();
  const x = ((ev.clientX - rect.left) * canvas.width) / rect.width - g.ox;
  const y = ((ev.clientY - rect.top) * canvas.height) / rect.height - g.oy;
  const c = Math.floor(x / g.cw), r = Math.floor(y / g.ch);
  return r >= 0 && r < g.rows && c >= 0 && c < g.cols ? { r, c } : null;
}

function topK(r, k) { // indices of the k largest entries of r
  const idx = [];
  for (let j = 0; j < r.length; j++) {
    if (idx.length < k) { idx.push(j); idx.sort((a, b) => r[b] - r[a]); }
    else if (r[j] > r[idx[k - 1]]) { idx[k - 1] = j; idx.sort((a, b) => r[b] - r[a]); }
  }
  return idx;
}
