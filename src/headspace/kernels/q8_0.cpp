// headspace::q8_0_mm: rows times a matrix held as GGUF Q8_0 blocks, without making the float32 matrix
// (built beside decode_rows.cpp into the same library by headspace/kernels/native.py; fed by
// headspace/kernels/q8_0.py).
//
// A Q8_0 matrix W [out, in] is, for each row o and each block b of 32 columns, one scale d[o, b] and 32
// integers q[o, 32 b + j] in [-127, 127]: W[o, 32 b + j] = d[o, b] * q[o, 32 b + j], a product float32
// holds exactly. For the rows x [n, in]:
//
//     y[r, o] = sum_k x[r, k] * W[o, k],   W[o, k] = d[o, k / 32] * q[o, k]
//
// the sum x W^T makes on the float32 matrix, of the same products (W's values made exactly, a tile of
// rows at a time in a buffer the L1 cache holds), reading a quarter of the bytes: equal to the GEMM's
// result to float32 rounding (the order of the additions differs). Each output is computed by one
// thread in a fixed order, so it does not depend on the number of threads; that order depends on the
// vector width (``level``: 0 plain C++ in column order, 1 AVX2 with FMA, 2 AVX-512F: one partial sum per
// lane, then the lanes), which the caller asks of torch (torch.backends.cpu.get_cpu_capability()); the
// outputs are split over torch's intra-op thread count (at::get_num_threads()). The AVX2 and AVX-512
// paths are one algorithm written twice: GCC's per-function target attributes do not carry through a
// shared template.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HEADSPACE_X86 1
#endif

namespace {

constexpr int64_t kBlock = 32;  // Q8_0's block: 32 integers and one scale

// outputs [o0, o1) of the rows x [n, in] (row r at x + r * in), y [n, out] (row r at y + r * out): each
// output the sum, in column order, of x's elements times W's (d * q, made float32 one at a time)
void rows_plain(const float* x, const int8_t* q, const float* d, float* y, int64_t n, int64_t in, int64_t out,
                int64_t o0, int64_t o1) {
  const int64_t nb = in / kBlock;
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* qo = q + o * in;
    const float* dof = d + o * nb;
    for (int64_t r = 0; r < n; ++r) {
      const float* xr = x + r * in;
      float acc = 0.0f;
      for (int64_t k = 0; k < in; ++k) {
        acc += xr[k] * (dof[k / kBlock] * static_cast<float>(qo[k]));
      }
      y[r * out + o] = acc;
    }
  }
}

#ifdef HEADSPACE_X86
// Both vector paths take the outputs kTile at a time: the tile's rows of W made float32 (d * q, W's own
// values exactly) into a buffer the L1 cache holds, then each row of x dotted with them, kTile
// independent sums (one vector accumulator each) at once.
constexpr int64_t kTile = 4;
constexpr int64_t kMaxIn = 8192;  // the buffer's columns: wider matrices take the plain path

__attribute__((target("avx2,fma"))) inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) void rows_avx2(const float* x, const int8_t* q, const float* d, float* y,
                                                   int64_t n, int64_t in, int64_t out, int64_t o0, int64_t o1) {
  const int64_t nb = in / kBlock;
  alignas(64) float buf[kTile][kMaxIn];  // 128 KB of the calling thread's stack
  int64_t o = o0;
  for (; o + kTile <= o1; o += kTile) {
    for (int64_t i = 0; i < kTile; ++i) {
      const int8_t* qo = q + (o + i) * in;
      const float* dof = d + (o + i) * nb;
      for (int64_t b = 0; b < nb; ++b) {
        const __m256 scale = _mm256_set1_ps(dof[b]);
        for (int k = 0; k < kBlock; k += 8) {
          __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qo + b * kBlock + k));
          __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale);
          _mm256_store_ps(buf[i] + b * kBlock + k, w);
        }
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      const float* xr = x + r * in;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
             a3 = _mm256_setzero_ps();
      for (int64_t k = 0; k < in; k += 8) {
        const __m256 xv = _mm256_loadu_ps(xr + k);
        a0 = _mm256_fmadd_ps(xv, _mm256_load_ps(buf[0] + k), a0);
        a1 = _mm256_fmadd_ps(xv, _mm256_load_ps(buf[1] + k), a1);
        a2 = _mm256_fmadd_ps(xv, _mm256_load_ps(buf[2] + k), a2);
        a3 = _mm256_fmadd_ps(xv, _mm256_load_ps(buf[3] + k), a3);
      }
      float* yr = y + r * out + o;
      yr[0] = sum8(a0);
      yr[1] = sum8(a1);
      yr[2] = sum8(a2);
      yr[3] = sum8(a3);
    }
  }
  if (o < o1) rows_plain(x, q, d, y, n, in, out, o, o1);
}

__attribute__((target("avx512f"))) void rows_avx512(const float* x, const int8_t* q, const float* d, float* y,
                                                    int64_t n, int64_t in, int64_t out, int64_t o0,
                                                    int64_t o1) {
  const int64_t nb = in / kBlock;
  alignas(64) float buf[kTile][kMaxIn];  // 128 KB of the calling thread's stack
  int64_t o = o0;
  for (; o + kTile <= o1; o += kTile) {
    for (int64_t i = 0; i < kTile; ++i) {
      const int8_t* qo = q + (o + i) * in;
      const float* dof = d + (o + i) * nb;
      for (int64_t b = 0; b < nb; ++b) {
        const __m512 scale = _mm512_set1_ps(dof[b]);
        for (int k = 0; k < kBlock; k += 16) {
          __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qo + b * kBlock + k));
          __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), scale);
          _mm512_store_ps(buf[i] + b * kBlock + k, w);
        }
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      const float* xr = x + r * in;
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(),
             a3 = _mm512_setzero_ps();
      for (int64_t k = 0; k < in; k += 16) {
        const __m512 xv = _mm512_loadu_ps(xr + k);
        a0 = _mm512_fmadd_ps(xv, _mm512_load_ps(buf[0] + k), a0);
        a1 = _mm512_fmadd_ps(xv, _mm512_load_ps(buf[1] + k), a1);
        a2 = _mm512_fmadd_ps(xv, _mm512_load_ps(buf[2] + k), a2);
        a3 = _mm512_fmadd_ps(xv, _mm512_load_ps(buf[3] + k), a3);
      }
      float* yr = y + r * out + o;
      yr[0] = _mm512_reduce_add_ps(a0);
      yr[1] = _mm512_reduce_add_ps(a1);
      yr[2] = _mm512_reduce_add_ps(a2);
      yr[3] = _mm512_reduce_add_ps(a3);
    }
  }
  if (o < o1) rows_plain(x, q, d, y, n, in, out, o, o1);
}
#endif

at::Tensor q8_0_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, int64_t level) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_cpu(),
              "q8_0_mm: x must be float32 CPU rows [n, in]; got ", x.scalar_type(), " of shape ", x.sizes());
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(),
              "q8_0_mm: q must be contiguous int8 [out, in]; got ", q.scalar_type(), " of shape ", q.sizes());
  const int64_t n = x.size(0), in = x.size(1), out = q.size(0);
  TORCH_CHECK(q.size(1) == in && in % kBlock == 0, "q8_0_mm: q [out, in] must have x's in = ", in,
              " columns, a multiple of 32; got ", q.sizes());
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == at::kFloat && d.is_contiguous() && d.size(0) == out &&
                  d.size(1) == in / kBlock,
              "q8_0_mm: d must be contiguous float32 [", out, ", ", in / kBlock, "]; got ", d.scalar_type(),
              " of shape ", d.sizes());
  TORCH_CHECK(level >= 0 && level <= 2, "q8_0_mm: level must be 0, 1 or 2; got ", level);
#ifdef HEADSPACE_X86
  TORCH_CHECK(level < 1 || (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")),
              "q8_0_mm: level 1 needs AVX2 and FMA, which this CPU has not");
  TORCH_CHECK(level < 2 || __builtin_cpu_supports("avx512f"), "q8_0_mm: level 2 needs AVX-512F, which this CPU has not");
#else
  TORCH_CHECK(level == 0, "q8_0_mm: only level 0 on this CPU; got ", level);
#endif
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({n, out}, x.options());
  const float* px = xc.const_data_ptr<float>();
  const int8_t* pq = q.const_data_ptr<int8_t>();
  const float* pd = d.const_data_ptr<float>();
  float* py = y.mutable_data_ptr<float>();
  auto part = [&](int64_t o0, int64_t o1) {
#ifdef HEADSPACE_X86
    if (level == 2 && in <= kMaxIn) return rows_avx512(px, pq, pd, py, n, in, out, o0, o1);
    if (level == 1 && in <= kMaxIn) return rows_avx2(px, pq, pd, py, n, in, out, o0, o1);
#endif
    rows_plain(px, pq, pd, py, n, in, out, o0, o1);
  };
  // torch's intra-op threads, each a contiguous range of outputs (whole tiles of 4). Built with -fopenmp
  // (torch's own libgomp.so.1: headspace/kernels/native.py, openmp_flags), at::parallel_for runs on
  // torch's OpenMP threads; without it (a renamed or other runtime, which a second copy would fight),
  // at::parallel_for would run on one thread, so threads of our own split the outputs.
#ifdef _OPENMP
  const int64_t tiles = (out + 3) / 4;
  at::parallel_for(0, tiles, 64, [&](int64_t t0, int64_t t1) { part(t0 * 4, std::min(out, t1 * 4)); });
  return y;
#else
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), out / 1024));
  const int64_t chunk = (out / threads + 3) / 4 * 4;
  std::vector<std::thread> pool;
  std::vector<std::exception_ptr> errors(threads);
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t o0 = std::min(out, t * chunk), o1 = t + 1 == threads ? out : std::min(out, (t + 1) * chunk);
    pool.emplace_back([&, t, o0, o1] {
      try {
        part(o0, o1);
      } catch (...) {
        errors[t] = std::current_exception();
      }
    });
  }
  part(0, std::min(out, chunk));
  for (auto& th : pool) th.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return y;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(headspace, m) {
  m.def("q8_0_mm(Tensor x, Tensor q, Tensor d, int level) -> Tensor");
  m.impl("q8_0_mm", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(q8_0_mm)));
}
