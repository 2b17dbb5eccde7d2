// headspace.DecodeStep: every block of a Decoder's cached decoding step on the new position's rows, in
// one call (built and loaded by headspace/kernels/native.py; fed by headspace/decode/native.py).
//
// The same arithmetic as the Python step (headspace.decode.python.layer_rows for each block, then the
// final norm), rounding for rounding, so its results are bit for bit the Python step's: the products,
// attention, the norms' sums and the activation are the same ATen calls; the elementwise steps around
// them (the norms' scaling, the rotation and cache writes, the residual adds, the gate's product) are
// float32 loops making the same single roundings. What it saves is the Python-level calls per block
// and a dozen ATen dispatches, not arithmetic.
//
// It covers Gemma 3's and its relatives' operations as the Python step runs them: RMSNorms of offset +
// weight (Gemma's 1 + w), QK-norm over each head's d_head or over all heads (then q and k rotated
// apart), sandwich and post-sublayer norms (a block without norm1 / norm2), per-layer rotations (each
// layer is handed its own tables; NoPE layers none) and sliding windows (a windowed cache written as
// headspace.decode.kv_cache.KVCache._append_windowed writes it, and the window's bool mask passed to
// attention).
//
// The step is described once, by name: add_layer takes one block's headspace.decode.step.LayerStep as
// four dicts keyed by its dotted field names (headspace.decode.step.named_fields: "norm1.weight",
// "qkv.kind", "n_heads", "rotary.dim", "q_norm.offset", "window", ...), and set_final_norm the final
// Norm's; a name it does not know, or one it needs and does not find, is an error naming it.
// run(x, ks, vs, start, cos, sin, held) then takes the rows x [batch, d_model], each layer's cache
// ks[l], vs[l] [batch, n_kv_heads, capacity, d_head] and its rotation tables cos[l], sin[l] [1, 1,
// rotary_dim] (None: no rotation), and held[l]: -1 for a full cache (the new keys and values are
// written at position start), else the positions a sliding-window cache holds (its buffers
// [batch, n_kv_heads, min(capacity, window), d_head]; the new ones go after them, or, the buffers full,
// the oldest drops out).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// The elementwise steps are plain float32 loops: each output element is the same one or two IEEE
// roundings ATen's kernels make (a multiply, then an add: no fused multiply-add, -ffp-contract=off),
// so they are bit for bit ATen's; the reductions (the norms' sums, the products, attention) stay ATen.

// The element offsets of x's rows (every index but the last, in row-major order) from its first element
std::vector<int64_t> row_offsets(const Tensor& x) {
  const int64_t nd = x.dim();
  int64_t n = 1;
  for (int64_t i = 0; i + 1 < nd; ++i) {
    n *= x.size(i);
  }
  std::vector<int64_t> out(n);
  for (int64_t r = 0; r < n; ++r) {
    int64_t rest = r, off = 0;
    for (int64_t i = nd - 2; i >= 0; --i) {
      off += (rest % x.size(i)) * x.stride(i);
      rest /= x.size(i);
    }
    out[r] = off;
  }
  return out;
}

// headspace.nn.norms.rms_norm of the rows of float32 x [..., d] (any strides, the last 1: a view of the
// fused projection too) into a fresh contiguous tensor of x's shape. Offset 0: F.rms_norm, as torch's
// CPU composite computes it, x * rsqrt(sum(x * x) / d + eps) * w; otherwise rms_norm's own steps,
// (x * rsqrt(mean(x^2) + eps)) * (offset + w) (Gemma's 1 + w: the offset added to the weight, in
// float32, at every call, as there). Each step one rounding; the sum of squares is ATen's (its
// summation order), of a contiguous tensor of x's shape as pow(x, 2) gives.
Tensor rms_norm(const Tensor& x, const OptTensor& w, double eps, double offset) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.stride(-1) == 1, "DecodeStep: rows must be float32, each contiguous");
  const int64_t d = x.size(-1);
  const std::vector<int64_t> rows = row_offsets(x);
  const int64_t n = static_cast<int64_t>(rows.size());
  Tensor sq = at::empty(x.sizes(), x.options());  // (..., d): x^2 (pow(x, 2) is x * x), contiguous
  const float* px = x.const_data_ptr<float>();
  float* ps = sq.mutable_data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < d; ++i) {
      ps[r * d + i] = px[rows[r] + i] * px[rows[r] + i];
    }
  }
  Tensor sums = sq.sum({-1}, true);  // (..., 1)
  const float* pr = sums.const_data_ptr<float>();
  Tensor out = at::empty(x.sizes(), x.options());  // (..., d), contiguous
  float* po = out.mutable_data_ptr<float>();
  TORCH_CHECK(!w.has_value() || (w->is_contiguous() && w->numel() == d && w->scalar_type() == at::kFloat),
              "DecodeStep: an RMSNorm weight must be a contiguous float32 [", d, "]");
  TORCH_CHECK(offset == 0.0 || w.has_value(), "DecodeStep: an RMSNorm with an offset needs its weight");
  const float* pw = w.has_value() ? w->const_data_ptr<float>() : nullptr;
  const float fd = static_cast<float>(d), feps = static_cast<float>(eps), foff = static_cast<float>(offset);
  for (int64_t r = 0; r < n; ++r) {
    const float mean = pr[r] / fd;  // mean: sum, then div_ by d
    const float scale = 1.0f / std::sqrt(mean + feps);  // add(eps), rsqrt
    const float* xr = px + rows[r];
    float* orow = po + r * d;
    for (int64_t i = 0; i < d; ++i) {
      const float y = xr[i] * scale;  // x.mul(rsqrt)
      if (pw == nullptr) {
        orow[i] = y;
      } else if (offset == 0.0) {
        orow[i] = y * pw[i];  // .mul(weight)
      } else {
        const float scale_w = foff + pw[i];  // offset + weight
        orow[i] = y * scale_w;  // hidden * (offset + weight)
      }
    }
  }
  return out;
}

// headspace.kernels.bf16.bf16_linear: the rows rounded to bfloat16, oneDNN's product on the packed
// copy (float32 sums), the result back in float32; from f32_rows rows (0: always, -1: never) the same
// products as a float32 GEMM on the rounded values
Tensor bf16_linear(const Tensor& x, const Tensor& values, const OptTensor& b, const OptTensor& packed,
                   int64_t f32_rows) {
  if (f32_rows >= 0 && x.numel() >= f32_rows * x.size(-1)) {
    Tensor xr = x.to(at::kBFloat16).to(at::kFloat);
    OptTensor br = b.has_value() ? OptTensor(b->to(at::kBFloat16).to(at::kFloat)) : std::nullopt;
    return at::linear(xr, values, br).to(at::kBFloat16).to(at::kFloat);
  }
  static auto pointwise =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, c10::string_view,
                        c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>)>();
  TORCH_CHECK(packed.has_value(), "DecodeStep: a bfloat16 product without its packed copy must run in float32");
  Tensor xb = x.to(at::kBFloat16).contiguous();
  OptTensor bb = b.has_value() ? OptTensor(b->to(at::kBFloat16)) : std::nullopt;
  Tensor y = pointwise.call(xb, *packed, bb, "none", c10::List<std::optional<c10::Scalar>>(), "");
  return y.to(at::kFloat);
}

// one product of the rows: kind 0 plain (mm or linear), 1 MKL's packed GEMM, 2 bfloat16 (f32_rows: see
// bf16_linear)
Tensor linear(const Tensor& x, const OptTensor& w, const OptTensor& b, const OptTensor& packed, int64_t rows,
              int64_t kind = 0, int64_t f32_rows = -1) {
  if (kind == 2) {
    return bf16_linear(x, *w, b, packed, f32_rows);
  }
  if (packed.has_value()) {
    static auto mkl_linear =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("mkl::_mkl_linear", "")
            .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t)>();
    return mkl_linear.call(x, *packed, *w, b, rows);
  }
  if (b.has_value()) {
    return at::linear(x, *w, b);
  }
  return at::mm(x, *w);
}

// A layer's rotation table (cos or the signed sin) for rd features, contiguous
Tensor rotation_table(const Tensor& t, int64_t rd) {
  Tensor c = t.contiguous();
  TORCH_CHECK(c.numel() == rd && c.scalar_type() == at::kFloat, "DecodeStep: cos and sin must hold ", rd,
              " float32 features; got ", c.numel(), " ", c.scalar_type());
  return c;
}

// One row of headspace.nn.positions.rotate_fused: out = x * cos + swap(x) * sin on the first rd features
// (swap: a roll by rd / 2 for rotate-half, kind 1; a flip within pairs, kind 2), the rest passed through
inline void rotate_row(const float* x, float* out, const float* pc, const float* pn, int64_t kind, int64_t rd,
                       int64_t dh) {
  const int64_t half = rd / 2;
  for (int64_t i = 0; i < rd; ++i) {
    const int64_t j = kind == 2 ? (i ^ 1) : (i < half ? i + half : i - half);
    const float a = x[i] * pc[i];
    const float t = x[j] * pn[i];
    out[i] = a + t;
  }
  for (int64_t i = rd; i < dh; ++i) {
    out[i] = x[i];
  }
}

inline void copy_row(const float* x, float* out, int64_t dh) {
  for (int64_t i = 0; i < dh; ++i) {
    out[i] = x[i];
  }
}

// One new position's fused projection qkv [B, H + 2 Hkv, 1, dh] (a contiguous [B, (H + 2 Hkv) dh]):
// the queries (returned, [B, H, 1, dh]: rotated, the first H heads of a fresh [B, H + Hkv, 1, dh], as
// the Python step's; unrotated, a view of qkv), the keys rotated into k_dst and the values copied into
// v_dst (each a [B, Hkv, 1, dh] view: the cache slots, or the last row of a full window's keys). The
// rotation is rotate_fused's of q and k in one call (rotate_row).
Tensor rotate_into(const Tensor& qkv, const Tensor& k_dst, const Tensor& v_dst, const OptTensor& cos,
                   const OptTensor& sin, int64_t kind, int64_t rd, int64_t H, int64_t Hkv, int64_t dh) {
  const int64_t B = qkv.size(0), heads = H + 2 * Hkv;
  const bool rotate = kind != 0 && cos.has_value() && sin.has_value();
  // q laid out as the Python step's: a view of the rotated [B, H + Hkv, 1, dh] (or, unrotated, of qkv
  // itself), so that attention's own products see the same strides and alignment (they may sum in
  // another order otherwise)
  const int64_t qheads = rotate ? H + Hkv : heads;
  Tensor qbuf = rotate ? at::empty({B, H + Hkv, 1, dh}, qkv.options()) : qkv.view({B, heads, 1, dh});
  const float* src = qkv.const_data_ptr<float>();
  float* pq = rotate ? qbuf.mutable_data_ptr<float>() : nullptr;
  float* pk = k_dst.mutable_data_ptr<float>();
  float* pv = v_dst.mutable_data_ptr<float>();
  const int64_t ks0 = k_dst.stride(0), ks1 = k_dst.stride(1), vs0 = v_dst.stride(0), vs1 = v_dst.stride(1);
  TORCH_CHECK(k_dst.stride(3) == 1 && v_dst.stride(3) == 1, "DecodeStep: cache rows must be contiguous");
  Tensor c, s;
  const float *pc = nullptr, *pn = nullptr;
  if (rotate) {
    c = rotation_table(*cos, rd);
    s = rotation_table(*sin, rd);
    pc = c.const_data_ptr<float>();
    pn = s.const_data_ptr<float>();
  }
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* x = src + (b * heads + h) * dh;
      if (!rotate && h < H) {
        continue;  // the queries stay in qkv
      }
      float* out = h < H ? pq + (b * qheads + h) * dh
                 : h < H + Hkv ? pk + b * ks0 + (h - H) * ks1
                               : pv + b * vs0 + (h - H - Hkv) * vs1;
      if (!rotate || h >= H + Hkv) {
        copy_row(x, out, dh);
      } else {
        rotate_row(x, out, pc, pn, kind, rd, dh);
      }
    }
  }
  return qbuf.narrow(1, 0, H);  // (B, H, 1, dh)
}

// a + b of two contiguous float32 [B, d] (into a fresh tensor), and a *= b in place
Tensor add_rows(const Tensor& a, const Tensor& b) {
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.sizes() == b.sizes(), "DecodeStep: add of ",
              a.sizes(), " and ", b.sizes());
  Tensor out = at::empty_like(a);
  const float *pa = a.const_data_ptr<float>(), *pb = b.const_data_ptr<float>();
  float* po = out.mutable_data_ptr<float>();
  for (int64_t i = 0, n = a.numel(); i < n; ++i) {
    po[i] = pa[i] + pb[i];
  }
  return out;
}

Tensor& mul_rows_(Tensor& a, const Tensor& b) {
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.sizes() == b.sizes(), "DecodeStep: mul of ",
              a.sizes(), " and ", b.sizes());
  float* pa = a.mutable_data_ptr<float>();
  const float* pb = b.const_data_ptr<float>();
  for (int64_t i = 0, n = a.numel(); i < n; ++i) {
    pa[i] = pa[i] * pb[i];
  }
  return a;
}

Tensor activate_(Tensor& x, int64_t act) {
  switch (act) {
    case 0:
      return at::silu_(x);
    case 1:
      return at::relu_(x);
    case 2:
      return at::gelu_(x, "none");
    default:
      return at::gelu_(x, "tanh");
  }
}


// One description's four dicts, read by name: each read marks the name used; finish() refuses a name
// nothing read (a field this step does not know).
struct Fields {
  c10::Dict<std::string, Tensor> tensors;
  c10::Dict<std::string, int64_t> ints;
  c10::Dict<std::string, double> floats;
  c10::Dict<std::string, std::string> texts;
  std::string where;
  std::set<std::string> used;

  bool has(const std::string& k) const {
    return tensors.contains(k) || ints.contains(k) || floats.contains(k) || texts.contains(k);
  }
  OptTensor tensor(const std::string& k) {
    used.insert(k);
    return tensors.contains(k) ? OptTensor(tensors.at(k)) : std::nullopt;
  }
  Tensor needed_tensor(const std::string& k) {
    OptTensor t = tensor(k);
    TORCH_CHECK(t.has_value(), "DecodeStep: ", where, " needs the tensor ", k);
    return *t;
  }
  int64_t integer(const std::string& k) {
    used.insert(k);
    TORCH_CHECK(ints.contains(k), "DecodeStep: ", where, " needs the int ", k);
    return ints.at(k);
  }
  double real(const std::string& k) {
    used.insert(k);
    TORCH_CHECK(floats.contains(k), "DecodeStep: ", where, " needs the float ", k);
    return floats.at(k);
  }
  std::string text(const std::string& k) {
    used.insert(k);
    TORCH_CHECK(texts.contains(k), "DecodeStep: ", where, " needs the string ", k);
    return texts.at(k);
  }
  void finish() const {
    auto check = [&](const std::string& k) {
      TORCH_CHECK(used.count(k) != 0, "DecodeStep: ", where, " has a field it does not know: ", k);
    };
    for (const auto& e : tensors) check(e.key());
    for (const auto& e : ints) check(e.key());
    for (const auto& e : floats) check(e.key());
    for (const auto& e : texts) check(e.key());
  }
};

// a product as linear() runs it: kind 0 float32 (w transposed [in, out] for mm where there is no bias, as
// it is [out, in] for linear with one), 1 MKL-packed, 2 bfloat16
struct Product {
  int64_t kind = 0;
  OptTensor w, b, packed;
  int64_t rows = 0, f32_rows = -1;

  Tensor operator()(const Tensor& x) const { return linear(x, w, b, packed, rows, kind, f32_rows); }
};

Product read_product(Fields& f, const std::string& name) {
  Product p;
  const std::string kind = f.text(name + ".kind");
  Tensor w = f.needed_tensor(name + ".weight");
  p.b = f.tensor(name + ".bias");
  p.packed = f.tensor(name + ".packed");
  p.rows = f.integer(name + ".rows");
  p.f32_rows = f.integer(name + ".float32_rows");
  if (kind == "float32") {
    p.kind = 0;
    p.packed = std::nullopt;
    p.w = p.b.has_value() ? w : w.t();  // mm(x, w^T) without bias, as torch.mm on the transposed view
  } else if (kind == "packed") {
    TORCH_CHECK(p.packed.has_value(), "DecodeStep: ", f.where, "'s ", name, " is packed without its packed copy");
    p.kind = 1;
    p.w = w;
  } else if (kind == "bfloat16") {
    p.kind = 2;
    p.w = w;
  } else {
    TORCH_CHECK(false, "DecodeStep: ", f.where, "'s ", name, ".kind must be float32, packed or bfloat16; got ", kind);
  }
  return p;
}

// a norm of the rows as the Python step runs it (headspace.decode.python.norm_fn): RMSNorm (any offset)
// or F.layer_norm over the last dim; none is the identity
struct Norm {
  int64_t kind = -1;  // 0 RMSNorm, 1 LayerNorm, -1 none
  OptTensor w, b;
  double eps = 0.0, offset = 0.0;

  Tensor operator()(const Tensor& x) const {
    if (kind < 0) {
      return x;
    }
    if (kind == 1) {
      return at::layer_norm(x, {x.size(-1)}, w, b, eps);
    }
    return rms_norm(x, w, eps, offset);
  }
};

Norm read_norm(Fields& f, const std::string& prefix) {
  Norm n;
  const std::string kind = f.text(prefix + "kind");
  TORCH_CHECK(kind == "rmsnorm" || kind == "layernorm", "DecodeStep: ", f.where, "'s ", prefix,
              "kind must be rmsnorm or layernorm; got ", kind);
  n.kind = kind == "rmsnorm" ? 0 : 1;
  n.w = f.tensor(prefix + "weight");
  n.b = f.tensor(prefix + "bias");
  n.eps = f.real(prefix + "eps");
  if (f.has(prefix + "offset")) {
    n.offset = f.real(prefix + "offset");
  }
  TORCH_CHECK(n.offset == 0.0 || n.kind == 0, "DecodeStep: ", f.where, "'s ", prefix,
              "offset is an RMSNorm's; a layernorm has none");
  return n;
}

// the norm prefix names, or none (the identity) where the description has no such norm
Norm read_norm_if(Fields& f, const std::string& prefix) {
  return f.has(prefix + "kind") ? read_norm(f, prefix) : Norm{};
}

struct Layer {
  Norm norm1, norm2, q_norm, k_norm, attn_out, mlp_out;
  Product qkv, o, gate, fc_in, fc_out;
  bool gated = false;
  int64_t H = 0, Hkv = 0, dh = 0, rot_kind = 0, rot_dim = 0, act = 0;
  int64_t qk_norm = 0;  // 0 none, 1 "head" (over each head's d_head), 2 "all" (over the concatenated heads)
  int64_t window = 0;  // a sliding window's width; 0 none
  double scale = 1.0;
};

// With QK-norm: the Python step's _normed_qk of the new q and k (views of the fused projection qkv, a
// contiguous [B, (H + 2 Hkv) dh]), then rotate_fused of q and of k apart, as that step does: returns q
// [B, H, 1, dh] (fresh and contiguous, as there), writes the keys into k_dst and the values into v_dst
// (each a [B, Hkv, 1, dh] view)
Tensor normed_into(const Layer& l, const Tensor& qkv, const Tensor& k_dst, const Tensor& v_dst, const OptTensor& cos,
                   const OptTensor& sin) {
  const int64_t B = qkv.size(0), H = l.H, Hkv = l.Hkv, dh = l.dh, heads = H + 2 * Hkv;
  Tensor q, k;
  if (l.qk_norm == 1) {
    Tensor rows = qkv.view({B, heads, 1, dh});  // (B, H + 2 Hkv, 1, dh)
    q = l.q_norm(rows.narrow(1, 0, H));  // (B, H, 1, dh)
    k = l.k_norm(rows.narrow(1, H, Hkv));  // (B, Hkv, 1, dh)
  } else {
    Tensor flat = qkv.view({B, 1, heads * dh});  // (B, 1, (H + 2 Hkv) dh): the heads concatenated
    q = l.q_norm(flat.narrow(2, 0, H * dh)).view({B, H, 1, dh});  // (B, 1, H dh) -> (B, H, 1, dh)
    k = l.k_norm(flat.narrow(2, H * dh, Hkv * dh)).view({B, Hkv, 1, dh});  // (B, 1, Hkv dh) -> (B, Hkv, 1, dh)
  }
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous(), "DecodeStep: QK-norm gave non-contiguous rows");
  const bool rotate = l.rot_kind != 0 && cos.has_value() && sin.has_value();
  Tensor qout = rotate ? at::empty({B, H, 1, dh}, qkv.options()) : q;  // (B, H, 1, dh)
  Tensor c, s;
  const float *pc = nullptr, *pn = nullptr;
  if (rotate) {
    c = rotation_table(*cos, l.rot_dim);
    s = rotation_table(*sin, l.rot_dim);
    pc = c.const_data_ptr<float>();
    pn = s.const_data_ptr<float>();
    const float* pq = q.const_data_ptr<float>();
    float* po = qout.mutable_data_ptr<float>();
    for (int64_t r = 0; r < B * H; ++r) {
      rotate_row(pq + r * dh, po + r * dh, pc, pn, l.rot_kind, l.rot_dim, dh);
    }
  }
  TORCH_CHECK(k_dst.stride(3) == 1 && v_dst.stride(3) == 1, "DecodeStep: cache rows must be contiguous");
  const float* pk = k.const_data_ptr<float>();
  const float* src = qkv.const_data_ptr<float>();
  float* kd = k_dst.mutable_data_ptr<float>();
  float* vd = v_dst.mutable_data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hkv; ++h) {
      float* out = kd + b * k_dst.stride(0) + h * k_dst.stride(1);
      if (rotate) {
        rotate_row(pk + (b * Hkv + h) * dh, out, pc, pn, l.rot_kind, l.rot_dim, dh);
      } else {
        copy_row(pk + (b * Hkv + h) * dh, out, dh);
      }
      copy_row(src + (b * heads + H + Hkv + h) * dh, vd + b * v_dst.stride(0) + h * v_dst.stride(1), dh);
    }
  }
  return qout;
}

// headspace.nn.masks.window_mask(1, Sk, window)[None, None]: bool [1, 1, 1, Sk], key j visible from the
// new position Sk - 1 iff Sk - 1 - window < j
Tensor window_mask(int64_t Sk, int64_t window) {
  Tensor m = at::empty({1, 1, 1, Sk}, at::TensorOptions().dtype(at::kBool));  // (1, 1, 1, Sk)
  bool* p = m.mutable_data_ptr<bool>();
  for (int64_t j = 0; j < Sk; ++j) {
    p[j] = j > Sk - 1 - window;
  }
  return m;
}

int64_t activation_code(const std::string& name, const std::string& where) {
  if (name == "silu") return 0;
  if (name == "relu") return 1;
  if (name == "gelu") return 2;
  TORCH_CHECK(name == "gelu_tanh", "DecodeStep: ", where, "'s activation must be silu, relu, gelu or gelu_tanh; got ", name);
  return 3;
}

struct DecodeStep : torch::CustomClassHolder {
  std::vector<Layer> layers;
  Norm final_norm;

  void add_layer(c10::Dict<std::string, Tensor> tensors, c10::Dict<std::string, int64_t> ints,
                 c10::Dict<std::string, double> floats, c10::Dict<std::string, std::string> texts) {
    Fields f{tensors, ints, floats, texts, "layer " + std::to_string(layers.size()), {}};
    Layer l;
    l.norm1 = read_norm_if(f, "norm1.");  // absent: a post-sublayer block (OLMo 2)
    l.norm2 = read_norm_if(f, "norm2.");
    l.attn_out = read_norm_if(f, "attn_out_norm.");  // sandwich and post-sublayer blocks
    l.mlp_out = read_norm_if(f, "mlp_out_norm.");
    l.qkv = read_product(f, "qkv");
    l.o = read_product(f, "o");
    l.gated = f.has("gate.kind");
    if (l.gated) {
      l.gate = read_product(f, "gate");
    }
    l.fc_in = read_product(f, "fc_in");
    l.fc_out = read_product(f, "fc_out");
    l.H = f.integer("n_heads");
    l.Hkv = f.integer("n_kv_heads");
    l.dh = f.integer("d_head");
    l.scale = f.real("scale");
    if (f.has("rotary.kind")) {
      const std::string kind = f.text("rotary.kind");
      TORCH_CHECK(kind == "half" || kind == "interleaved", "DecodeStep: ", f.where,
                  "'s rotary.kind must be half or interleaved; got ", kind);
      l.rot_kind = kind == "half" ? 1 : 2;
      l.rot_dim = f.integer("rotary.dim");
    }
    if (f.has("qk_norm")) {
      const std::string kind = f.text("qk_norm");
      TORCH_CHECK(kind == "head" || kind == "all", "DecodeStep: ", f.where, "'s qk_norm must be head or all; got ",
                  kind);
      l.qk_norm = kind == "head" ? 1 : 2;
      l.q_norm = read_norm(f, "q_norm.");
      l.k_norm = read_norm(f, "k_norm.");
    }
    if (f.has("window")) {
      l.window = f.integer("window");
      TORCH_CHECK(l.window > 0, "DecodeStep: ", f.where, "'s window must be positive; got ", l.window);
    }
    l.act = activation_code(f.text("activation"), f.where);
    f.finish();
    layers.push_back(std::move(l));
  }

  void set_final_norm(c10::Dict<std::string, Tensor> tensors, c10::Dict<std::string, int64_t> ints,
                      c10::Dict<std::string, double> floats, c10::Dict<std::string, std::string> texts) {
    Fields f{tensors, ints, floats, texts, "the final norm", {}};
    final_norm = read_norm(f, "");
    f.finish();
  }

  int64_t n_layers() const { return static_cast<int64_t>(layers.size()); }

  Tensor run(Tensor x, c10::List<Tensor> ks, c10::List<Tensor> vs, int64_t start,
             c10::List<std::optional<Tensor>> cos, c10::List<std::optional<Tensor>> sin, c10::List<int64_t> held) {
    const int64_t L = n_layers();
    TORCH_CHECK(x.dim() == 2, "DecodeStep.run: x must be [batch, d_model]; got ", x.sizes());
    TORCH_CHECK(static_cast<int64_t>(ks.size()) == L && static_cast<int64_t>(vs.size()) == L, "DecodeStep.run: ",
                L, " layers need ", L, " key and value caches; got ", ks.size(), " and ", vs.size());
    TORCH_CHECK(static_cast<int64_t>(cos.size()) == L && static_cast<int64_t>(sin.size()) == L &&
                    static_cast<int64_t>(held.size()) == L,
                "DecodeStep.run: ", L, " layers need ", L, " cos, sin and held entries; got ", cos.size(), ", ",
                sin.size(), " and ", held.size());
    const int64_t B = x.size(0);
    TORCH_CHECK(x.scalar_type() == at::kFloat, "DecodeStep.run: float32 rows only; got ", x.scalar_type());
    x = x.contiguous();
    for (int64_t i = 0; i < L; ++i) {
      const Layer& l = layers[i];
      Tensor k_layer = ks.get(i), v_layer = vs.get(i);  // (B, Hkv, capacity, dh)
      TORCH_CHECK(k_layer.dim() == 4 && v_layer.sizes() == k_layer.sizes() && k_layer.size(0) == B &&
                      k_layer.size(1) == l.Hkv && k_layer.size(3) == l.dh && k_layer.scalar_type() == at::kFloat &&
                      v_layer.scalar_type() == at::kFloat,
                  "DecodeStep.run: layer ", i, "'s caches must be float32 [batch=", B, ", n_kv_heads=", l.Hkv,
                  ", capacity, d_head=", l.dh, "]; got ", k_layer.sizes(), " and ", v_layer.sizes());
      const int64_t kept = held.get(i), rows = k_layer.size(2);
      // where the new key and value go (k_dst, v_dst: [B, Hkv, 1, dh]), the keys and values attention
      // reads ([B, Hkv, Sk, dh]) and its mask
      Tensor k_dst, v_dst, k_att, v_att;
      OptTensor mask;
      bool full_window = false;
      if (kept < 0) {  // a full cache: position start, then every filled one (no mask)
        TORCH_CHECK(start >= 0 && start < rows, "DecodeStep.run: position ", start, " outside layer ", i,
                    "'s cache capacity ", rows);
        k_dst = k_layer.narrow(2, start, 1);
        v_dst = v_layer.narrow(2, start, 1);
        k_att = k_layer.narrow(2, 0, start + 1);
        v_att = v_layer.narrow(2, 0, start + 1);
      } else {  // a sliding window's cache, as KVCache._append_windowed: the held keys, then the new one
        TORCH_CHECK(l.window > 0, "DecodeStep.run: layer ", i, " has no window; its cache holds one");
        TORCH_CHECK(kept <= rows, "DecodeStep.run: layer ", i, "'s windowed cache holds ", rows,
                    " positions, not ", kept);
        if (kept + 1 <= rows) {  // room left: written in place, the buffers viewed
          k_dst = k_layer.narrow(2, kept, 1);
          v_dst = v_layer.narrow(2, kept, 1);
          k_att = k_layer.narrow(2, 0, kept + 1);
          v_att = v_layer.narrow(2, 0, kept + 1);
        } else {  // full: the held ones and the new one in fresh tensors (torch.cat's), the oldest dropped
          full_window = true;
          k_att = at::empty({B, l.Hkv, kept + 1, l.dh}, k_layer.options());  // (B, Hkv, held + 1, dh)
          v_att = at::empty({B, l.Hkv, kept + 1, l.dh}, v_layer.options());
          k_att.narrow(2, 0, kept).copy_(k_layer.narrow(2, 0, kept));
          v_att.narrow(2, 0, kept).copy_(v_layer.narrow(2, 0, kept));
          k_dst = k_att.narrow(2, kept, 1);
          v_dst = v_att.narrow(2, kept, 1);
        }
        mask = window_mask(kept + 1, l.window);  // (1, 1, 1, held + 1)
      }
      Tensor qkv = l.qkv(l.norm1(x));  // (B, (H + 2 Hkv) dh)
      TORCH_CHECK(qkv.is_contiguous() && qkv.size(1) == (l.H + 2 * l.Hkv) * l.dh, "DecodeStep.run: layer ", i,
                  "'s qkv product gave ", qkv.sizes());
      const OptTensor c = cos.get(i), s = sin.get(i);
      Tensor q = l.qk_norm != 0
                     ? normed_into(l, qkv, k_dst, v_dst, c, s)
                     : rotate_into(qkv, k_dst, v_dst, c, s, l.rot_kind, l.rot_dim, l.H, l.Hkv, l.dh);  // (B, H, 1, dh)
      if (full_window) {  // the buffers keep the last rows of them
        k_layer.copy_(k_att.narrow(2, kept + 1 - rows, rows));
        v_layer.copy_(v_att.narrow(2, kept + 1 - rows, rows));
      }
      Tensor z = at::scaled_dot_product_attention(q, k_att, v_att, mask, 0.0, false, l.scale,
                                                  l.H != l.Hkv);  // (B, H, 1, dh)
      Tensor h = add_rows(x, l.attn_out(l.o(z.reshape({B, l.H * l.dh}))));  // (B, d_model)
      Tensor m = l.norm2(h);
      if (l.gated) {
        Tensor g = l.gate(m);
        activate_(g, l.act);
        m = mul_rows_(g, l.fc_in(m));  // act(gate) * up
      } else {
        Tensor u = l.fc_in(m);
        m = activate_(u, l.act);
      }
      x = add_rows(h, l.mlp_out(l.fc_out(m)));  // (B, d_model)
    }
    return final_norm(x);
  }
};

}  // namespace

TORCH_LIBRARY(headspace, m) {
  m.class_<DecodeStep>("DecodeStep")
      .def(torch::init<>())
      .def("add_layer", &DecodeStep::add_layer)
      .def("set_final_norm", &DecodeStep::set_final_norm)
      .def("n_layers", &DecodeStep::n_layers)
      .def("run", &DecodeStep::run);
}
