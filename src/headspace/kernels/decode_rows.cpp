// headspace::decode_rows: every block of a Decoder's cached decoding step on the new position's rows,
// in one call (built and loaded by headspace/kernels/native.py; see its docstring).
//
// The same ATen operations, in the same order and on the same views, as the Python step
// (headspace.block.decode_layer_rows for each block, then the final norm), so its results are bit for
// bit the Python step's: what it saves is the ~25 Python-level calls per block (1.5-2.5 us each on a
// 2-core CPU), not arithmetic. Shapes: x [batch, d_model]; the stacked caches k_all, v_all
// [layers, batch, n_kv_heads, capacity, d_head]; cos, sin [1, 1, rotary_dim].
//
// Per block, LAYER_PARAMS tensors (None where absent) and LAYER_INTS ints, LAYER_FLOATS floats:
//   params: norm1 weight, norm1 bias, qkv, qkv bias, o, o bias, norm2 weight, norm2 bias,
//           gate, gate bias, in, in bias, out, out bias
//           (a product without bias holds its weight transposed, [in, out], and runs mm(x, w); with a
//           bias it holds the weight [out, in] and runs linear(x, w, b), as headspace.block.linear_fn)
//   ints:   norm kind (0 RMSNorm, 1 LayerNorm), n_heads, n_kv_heads, d_head,
//           rotary kind (0 none, 1 rotate-half, 2 interleaved), rotary_dim, gated (0/1),
//           activation (0 silu, 1 relu, 2 gelu, 3 gelu tanh)
//   floats: norm1 eps, norm2 eps, scale
// then the final norm: 2 params (weight, bias), 1 int (kind, -1 for none), 1 float (eps).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

constexpr int64_t LAYER_PARAMS = 14;
constexpr int64_t LAYER_INTS = 8;
constexpr int64_t LAYER_FLOATS = 3;

Tensor norm(const Tensor& x, int64_t kind, const OptTensor& w, const OptTensor& b, double eps) {
  const int64_t d = x.size(1);
  if (kind == 0) {
    return at::rms_norm(x, {d}, w, eps);
  }
  return at::layer_norm(x, {d}, w, b, eps);
}

Tensor linear(const Tensor& x, const OptTensor& w, const OptTensor& b) {
  if (b.has_value()) {
    return at::linear(x, *w, b);
  }
  return at::mm(x, *w);
}

// headspace.attention.rotate_fused: x * cos + turn(x) * sin on the first rotary_dim features
Tensor rotate(const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t kind, int64_t rd) {
  const int64_t dh = x.size(-1);
  Tensor xr = rd == dh ? x : x.slice(-1, 0, rd);
  Tensor swapped = kind == 2 ? xr.unflatten(-1, {rd / 2, 2}).flip({-1}).flatten(-2)
                             : xr.roll({rd / 2}, {-1});
  Tensor out = xr * cos;
  out += swapped * sin;
  if (rd == dh) {
    return out;
  }
  return at::cat({out, x.slice(-1, rd)}, -1);
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
  for (int64_t l = 0; l < L; ++l) {
    auto p = [&](int64_t i) -> OptTensor { return params.get(l * LAYER_PARAMS + i); };
    const int64_t* c = ints.data() + l * LAYER_INTS;
    const double* f = floats.data() + l * LAYER_FLOATS;
    const int64_t H = c[1], Hkv = c[2], dh = c[3];
    TORCH_CHECK(k_all.size(2) == Hkv && k_all.size(4) == dh, "decode_rows: layer ", l, " has ", Hkv,
                " key/value heads of ", dh, " features; the caches hold ", k_all.size(2), " of ",
                k_all.size(4));
    Tensor qkv = linear(norm(x, c[0], p(0), p(1), f[0]), p(2), p(3)).view({B, H + 2 * Hkv, 1, dh});
    auto parts = qkv.split_with_sizes({H + Hkv, Hkv}, 1);  // (B, H + Hkv, 1, dh), (B, Hkv, 1, dh)
    Tensor qk = parts[0];
    if (cos.has_value() && sin.has_value() && c[4] != 0) {
      qk = rotate(qk, *cos, *sin, c[4], c[5]);
    }
    auto q_k = qk.split_with_sizes({H, Hkv}, 1);  // (B, H, 1, dh), (B, Hkv, 1, dh)
    Tensor k_layer = k_all.select(0, l), v_layer = v_all.select(0, l);  // (B, Hkv, capacity, dh)
    k_layer.narrow(2, start, 1).copy_(q_k[1]);
    v_layer.narrow(2, start, 1).copy_(parts[1]);
    Tensor z = at::scaled_dot_product_attention(q_k[0], k_layer.narrow(2, 0, start + 1),
                                                v_layer.narrow(2, 0, start + 1), std::nullopt, 0.0,
                                                false, f[2], H != Hkv);  // (B, H, 1, dh)
    Tensor h = x + linear(z.reshape({B, H * dh}), p(4), p(5));  // (B, d_model)
    Tensor m = norm(h, c[0], p(6), p(7), f[1]);
    if (c[6] != 0) {
      Tensor g = linear(m, p(8), p(9));
      m = activate_(g, c[7]).mul_(linear(m, p(10), p(11)));  // act(gate) * up
    } else {
      Tensor u = linear(m, p(10), p(11));
      m = activate_(u, c[7]);
    }
    x = h + linear(m, p(12), p(13));  // (B, d_model)
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
