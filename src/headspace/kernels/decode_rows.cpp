// headspace::decode_rows: every block of a Decoder's cached decoding step on the new position's rows,
// in one call (built and loaded by headspace/kernels/native.py; see its docstring).
//
// The same arithmetic as the Python step (headspace.block.decode_layer_rows for each block, then the
// final norm), rounding for rounding, so its results are bit for bit the Python step's: the products,
// attention, the norms' sums and the activation are the same ATen calls; the elementwise steps around
// them (the norms' scaling, the rotation and cache writes, the residual adds, the gate's product) are
// float32 loops making the same single roundings. What it saves is the ~25 Python-level calls per block
// (1.5-2.5 us each on a 2-core CPU) and ~15 ATen dispatches, not arithmetic. Shapes: x [batch, d_model]; the stacked caches k_all, v_all
// [layers, batch, n_kv_heads, capacity, d_head]; cos, sin [1, 1, rotary_dim].
//
// Per block, LAYER_PARAMS tensors (None where absent) and LAYER_INTS ints, LAYER_FLOATS floats:
//   params: norm1 weight, norm1 bias, qkv, qkv bias, o, o bias, norm2 weight, norm2 bias,
//           gate, gate bias, in, in bias, out, out bias, then the packed copies of qkv, o, gate, in, out
//           (a product without bias holds its weight transposed, [in, out], and runs mm(x, w); with a
//           bias it holds the weight [out, in] and runs linear(x, w, b), as headspace.block.linear_fn;
//           with a packed copy it holds the weight [out, in] and runs mkl::_mkl_linear(x, packed, w, b,
//           rows), as headspace.kernels.prepack.packed_linear_fn, or for bfloat16 weights (their
//           float32 values [out, in] and oneDNN's packed bfloat16 copy) headspace.kernels.bf16.bf16_linear)
//   ints:   norm kind (0 RMSNorm, 1 LayerNorm), n_heads, n_kv_heads, d_head,
//           rotary kind (0 none, 1 rotate-half, 2 interleaved), rotary_dim, gated (0/1),
//           activation (0 silu, 1 relu, 2 gelu, 3 gelu tanh), the rows the weights are packed for (0: not),
//           the products' kind (0 float32, 1 float32 packed for MKL, 2 bfloat16), and for bfloat16
//           from how many rows products run as float32 GEMMs on the rounded values (0: all, -1: none;
//           headspace.kernels.bf16.float32_rows; a bfloat16 weight without packed copy has 0)
//   floats: norm1 eps, norm2 eps, scale
// then the final norm: 2 params (weight, bias), 1 int (kind, -1 for none), 1 float (eps).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <optional>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

constexpr int64_t LAYER_PARAMS = 19;
constexpr int64_t LAYER_INTS = 11;
constexpr int64_t LAYER_FLOATS = 3;

// The elementwise steps are plain float32 loops: each output element is the same one or two IEEE
// roundings ATen's kernels make (a multiply, then an add: no fused multiply-add, -ffp-contract=off),
// so they are bit for bit ATen's; the reductions (the norms' sums, the products, attention) stay ATen.

// F.rms_norm of float32 rows [B, d], as torch's CPU composite computes it: x * rsqrt(sum(x * x) / d +
// eps) * w, each step one rounding; the sum of squares is ATen's (its summation order). F.layer_norm
Tensor norm(const Tensor& x, int64_t kind, const OptTensor& w, const OptTensor& b, double eps) {
  const int64_t B = x.size(0), d = x.size(1);
  if (kind != 0) {
    return at::layer_norm(x, {d}, w, b, eps);
  }
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat, "decode_rows: rows must be contiguous float32");
  Tensor sq = at::empty_like(x);  // (B, d): x^2 (pow(x, 2) is x * x)
  const float* px = x.const_data_ptr<float>();
  float* ps = sq.mutable_data_ptr<float>();
  for (int64_t i = 0; i < B * d; ++i) {
    ps[i] = px[i] * px[i];
  }
  Tensor sums = sq.sum({-1}, true);  // (B, 1)
  const float* pr = sums.const_data_ptr<float>();
  Tensor out = at::empty_like(x);
  float* po = out.mutable_data_ptr<float>();
  TORCH_CHECK(!w.has_value() || (w->is_contiguous() && w->numel() == d && w->scalar_type() == at::kFloat),
              "decode_rows: an RMSNorm weight must be a contiguous float32 [", d, "]");
  const float* pw = w.has_value() ? w->const_data_ptr<float>() : nullptr;
  const float fd = static_cast<float>(d), feps = static_cast<float>(eps);
  for (int64_t r = 0; r < B; ++r) {
    const float mean = pr[r] / fd;  // mean: sum, then div_ by d
    const float scale = 1.0f / std::sqrt(mean + feps);  // add_(eps), rsqrt
    for (int64_t i = 0; i < d; ++i) {
      const float y = px[r * d + i] * scale;  // x.mul(rsqrt)
      po[r * d + i] = pw != nullptr ? y * pw[i] : y;  // .mul(weight)
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
  TORCH_CHECK(packed.has_value(), "decode_rows: a bfloat16 product without its packed copy must run in float32");
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

// One new position's fused projection qkv [B, H + 2 Hkv, 1, dh] (a contiguous [B, (H + 2 Hkv) dh]):
// the queries (returned, [B, H, 1, dh]: rotated, the first H heads of a fresh [B, H + Hkv, 1, dh], as
// the Python step's; unrotated, a view of qkv), the keys rotated into the cache slots
// k_slot and the values copied into v_slot (each [B, Hkv, 1, dh] views). Rotation as
// headspace.attention.rotate_fused: out = x * cos + swap(x) * sin on the first rd features (swap: a
// roll by rd / 2 for rotate-half, kind 1; a flip within pairs, kind 2), the rest passed through.
Tensor rotate_into(const Tensor& qkv, const Tensor& k_slot, const Tensor& v_slot, const OptTensor& cos,
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
  float* pk = k_slot.mutable_data_ptr<float>();
  float* pv = v_slot.mutable_data_ptr<float>();
  const int64_t ks0 = k_slot.stride(0), ks1 = k_slot.stride(1), vs0 = v_slot.stride(0), vs1 = v_slot.stride(1);
  TORCH_CHECK(k_slot.stride(3) == 1 && v_slot.stride(3) == 1, "decode_rows: cache rows must be contiguous");
  Tensor c, s;
  const float *pc = nullptr, *pn = nullptr;
  if (rotate) {
    c = cos->contiguous();
    s = sin->contiguous();
    TORCH_CHECK(c.numel() == rd && s.numel() == rd, "decode_rows: cos and sin must hold ", rd, " features; got ",
                c.numel(), " and ", s.numel());
    pc = c.const_data_ptr<float>();
    pn = s.const_data_ptr<float>();
  }
  const int64_t half = rd / 2;
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
        for (int64_t i = 0; i < dh; ++i) {
          out[i] = x[i];
        }
        continue;
      }
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
  }
  return qbuf.narrow(1, 0, H);  // (B, H, 1, dh)
}

// a + b of two contiguous float32 [B, d] (into a fresh tensor), and a *= b in place
Tensor add_rows(const Tensor& a, const Tensor& b) {
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.sizes() == b.sizes(), "decode_rows: add of ",
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
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.sizes() == b.sizes(), "decode_rows: mul of ",
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

Tensor decode_rows(
    Tensor x,
    const c10::List<OptTensor>& params,
    c10::IntArrayRef ints,
    c10::ArrayRef<double> floats,
    const Tensor& k_all,
    const Tensor& v_all,
    int64_t start,
    const OptTensor& cos,
    const OptTensor& sin) {
  const int64_t L = k_all.size(0);
  TORCH_CHECK(x.dim() == 2, "decode_rows: x must be [batch, d_model]; got ", x.sizes());
  TORCH_CHECK(k_all.dim() == 5 && v_all.sizes() == k_all.sizes(),
              "decode_rows: k_all and v_all must be [layers, batch, n_kv_heads, capacity, d_head]; got ",
              k_all.sizes(), " and ", v_all.sizes());
  TORCH_CHECK(static_cast<int64_t>(params.size()) == L * LAYER_PARAMS + 2 &&
                  static_cast<int64_t>(ints.size()) == L * LAYER_INTS + 1 &&
                  static_cast<int64_t>(floats.size()) == L * LAYER_FLOATS + 1,
              "decode_rows: ", L, " layers need ", L * LAYER_PARAMS + 2, " params, ", L * LAYER_INTS + 1,
              " ints and ", L * LAYER_FLOATS + 1, " floats; got ", params.size(), ", ", ints.size(),
              " and ", floats.size());
  TORCH_CHECK(start >= 0 && start < k_all.size(3), "decode_rows: position ", start,
              " outside the caches' capacity ", k_all.size(3));
  const int64_t B = x.size(0);
  TORCH_CHECK(k_all.size(1) == B, "decode_rows: caches of batch ", k_all.size(1), " for ", B, " rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat && k_all.scalar_type() == at::kFloat,
              "decode_rows: float32 rows and caches only; got ", x.scalar_type(), " and ", k_all.scalar_type());
  x = x.contiguous();
  for (int64_t l = 0; l < L; ++l) {
    auto p = [&](int64_t i) -> OptTensor { return params.get(l * LAYER_PARAMS + i); };
    const int64_t* c = ints.data() + l * LAYER_INTS;
    const double* f = floats.data() + l * LAYER_FLOATS;
    const int64_t H = c[1], Hkv = c[2], dh = c[3];
    TORCH_CHECK(k_all.size(2) == Hkv && k_all.size(4) == dh, "decode_rows: layer ", l, " has ", Hkv,
                " key/value heads of ", dh, " features; the caches hold ", k_all.size(2), " of ",
                k_all.size(4));
    const int64_t rows = c[8], kind = c[9];
    const int64_t f32_rows = c[10];
    Tensor qkv = linear(norm(x, c[0], p(0), p(1), f[0]), p(2), p(3), p(14), rows, kind, f32_rows);  // (B, (H + 2 Hkv) dh)
    TORCH_CHECK(qkv.is_contiguous() && qkv.size(1) == (H + 2 * Hkv) * dh, "decode_rows: layer ", l,
                "'s qkv product gave ", qkv.sizes());
    Tensor k_layer = k_all.select(0, l), v_layer = v_all.select(0, l);  // (B, Hkv, capacity, dh)
    Tensor q = rotate_into(qkv, k_layer.narrow(2, start, 1), v_layer.narrow(2, start, 1), cos, sin, c[4],
                           c[5], H, Hkv, dh);  // (B, H, 1, dh)
    Tensor z = at::scaled_dot_product_attention(q, k_layer.narrow(2, 0, start + 1),
                                                v_layer.narrow(2, 0, start + 1), std::nullopt, 0.0,
                                                false, f[2], H != Hkv);  // (B, H, 1, dh)
    Tensor h = add_rows(x, linear(z.reshape({B, H * dh}), p(4), p(5), p(15), rows, kind, f32_rows));  // (B, d_model)
    Tensor m = norm(h, c[0], p(6), p(7), f[1]);
    if (c[6] != 0) {
      Tensor g = linear(m, p(8), p(9), p(16), rows, kind, f32_rows);
      activate_(g, c[7]);
      m = mul_rows_(g, linear(m, p(10), p(11), p(17), rows, kind, f32_rows));  // act(gate) * up
    } else {
      Tensor u = linear(m, p(10), p(11), p(17), rows, kind, f32_rows);
      m = activate_(u, c[7]);
    }
    x = add_rows(h, linear(m, p(12), p(13), p(18), rows, kind, f32_rows));  // (B, d_model)
  }
  const int64_t final_kind = ints[L * LAYER_INTS];
  if (final_kind < 0) {
    return x;
  }
  return norm(x, final_kind, params.get(L * LAYER_PARAMS), params.get(L * LAYER_PARAMS + 1),
              floats[L * LAYER_FLOATS]);
}

}  // namespace

TORCH_LIBRARY(headspace, m) {
  m.def(
      "decode_rows(Tensor x, Tensor?[] params, int[] ints, float[] floats, Tensor(a!) k_all, "
      "Tensor(b!) v_all, int start, Tensor? cos, Tensor? sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(headspace, CompositeExplicitAutograd, m) {
  m.impl("decode_rows", &decode_rows);
}
