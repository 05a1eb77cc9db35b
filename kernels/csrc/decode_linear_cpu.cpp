// y_i = x · w_iᵀ (· scale_i), for the few float32 rows of a decode step on CPU and one or
// more weights that read the same x: the implementations of `lathe::decode_linear_cpu`
// (float32, bfloat16 or float16 weights, the half ones widened to float32 in registers) and
// `lathe::decode_linear_int8_cpu` (int8 weights with a float32 scale per output feature,
// serving's weight-only int8), whose schemas, fakes and graph pass are in
// lathe/kernels/decode_linear.py. At a few rows, BLAS's GEMM pays a fixed cost per call that
// is most of the time for a small model's layers, and streams a large weight (the LM head)
// at a fraction of the rate two cores can read it; torch's int8 GEMM takes bf16 rows and
// pays the same fixed cost. Here each task takes a range of output features, four weight
// rows at a time, against one x row (float32) or four (the others): each weight vector is
// loaded (and, but for float32, widened to float) once for the tile's rows, and each x vector once for the
// four features, into register sums that are reduced only at the end. On a CPU with AVX-512
// BF16 a bf16 weight instead meets x rounded to bf16 once a call, 32 products an instruction
// (`vdpbf16ps`): widening a bf16 vector costs three instructions for its 16 products, which
// held the 88M model's layers to 15 GB/s of weights at one row (27 GB/s for float32's). On
// a CPU with AMX, a bf16 weight's calls of 16 rows and more multiply in its tiles
// (`features_amx`): a prefill's GEMM is compute-bound, and there AVX-512 BF16 took 4.8× as
// long (2048 × 768 at 512 rows on a 2-core Sapphire Rapids: 16.4 ms against 3.4).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

// AMX intrinsics came with GCC 11 and clang 12, and the tile state is asked of Linux: other
// builds leave the AMX path out and keep the rest
#if defined(CPU_CAPABILITY_AVX512) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define LATHE_WITH_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>



namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

template <typename W>
Vec load(const W* p, int64_t count);

template <>
inline Vec load(const float* p, int64_t count) {
  return count == kLanes ? Vec::loadu(p) : Vec::loadu(p, count);
}

template <>
inline Vec load(const int8_t* p, int64_t count) {
  return at::vec::convert<float>(at::vec::Vectorized<int8_t>::loadu(p, count));
}

template <>
inline Vec load(const at::BFloat16* p, int64_t count) {
  return at::vec::convert<float>(at::vec::Vectorized<at::BFloat16>::loadu(p, count));
}

template <>
inline Vec load(const at::Half* p, int64_t count) {
  return at::vec::convert<float>(at::vec::Vectorized<at::Half>::loadu(p, count));
}

inline float sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

template <int K>
struct Width {
  static constexpr int64_t get(int64_t) { return K; }
};
template <>
struct Width<0> {  // in_features known only at run time
  static int64_t get(int64_t k) { return k; }
};

// out[r, f] for R x rows from `x` and F weight rows from `w`, over k inputs
template <int R, int F, int K, typename W>
inline void tile(const float* x, const W* w, int64_t in_features, const float* scale,
                 float* out, int64_t out_features) {
  const int64_t k = Width<K>::get(in_features);
  // the loops over r and f unrolled whole, so that acc stays in registers
  Vec acc[R][F];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int f = 0; f < F; ++f) acc[r][f] = Vec(0.f);
  for (int64_t i = 0; i < k; i += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, k - i);
    Vec wv[F];
#pragma GCC unroll 4
    for (int f = 0; f < F; ++f) wv[f] = load(w + f * k + i, count);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const Vec xv = load(x + r * k + i, count);
#pragma GCC unroll 4
      for (int f = 0; f < F; ++f) acc[r][f] = at::vec::fmadd(xv, wv[f], acc[r][f]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int f = 0; f < F; ++f)
      out[r * out_features + f] = scale ? sum(acc[r][f]) * scale[f] : sum(acc[r][f]);
}

// x rows per tile. A float32 weight vector costs one load, and its x rows are best read one
// at a time (tiles of four took 5-15% longer at 4-32 rows); an int8 or half one costs a load
// and conversions, which a tile of four rows shares (int8, 16 × 128 → 4096: 134 µs, against
// 207 µs in tiles of one)
template <typename W>
constexpr int kTileRows = 4;
template <>
constexpr int kTileRows<float> = 1;

template <int F, int K, typename W>
void rows_of(const float* x, int64_t rows, const W* w, int64_t in_features, const float* scale,
             float* out, int64_t out_features) {
  constexpr int R = kTileRows<W>;
  const int64_t k = Width<K>::get(in_features);
  int64_t m = 0;
  for (; m + R <= rows; m += R)
    tile<R, F, K>(x + m * k, w, k, scale, out + m * out_features, out_features);
  if constexpr (R > 1) {
    const float* xm = x + m * k;
    float* om = out + m * out_features;
    switch (rows - m) {
      case 3: tile<3, F, K>(xm, w, k, scale, om, out_features); break;
      case 2: tile<2, F, K>(xm, w, k, scale, om, out_features); break;
      case 1: tile<1, F, K>(xm, w, k, scale, om, out_features); break;
      default: break;
    }
  }
}

// x · w for one x row and one weight row, four sums in flight: one x row reads each weight
// row whole, in address order, which the hardware prefetcher follows best (tiles of four
// weight rows read four places at once: 27 GB/s of float32 weights against 34 from huge
// pages on the 88M model's layers)
template <int K, typename W>
inline float dot(const float* x, const W* w, int64_t in_features) {
  const int64_t k = Width<K>::get(in_features);
  Vec acc[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
  int64_t i = 0;
  for (; i + 4 * kLanes <= k; i += 4 * kLanes) {
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u)
      acc[u] = at::vec::fmadd(Vec::loadu(x + i + u * kLanes), load(w + i + u * kLanes, kLanes),
                              acc[u]);
  }
  for (; i < k; i += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, k - i);
    acc[0] = at::vec::fmadd(load(x + i, count), load(w + i, count), acc[0]);
  }
  return sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
}

template <int K, typename W>
void features(const float* x, int64_t rows, const W* w, const float* scale, float* out,
              int64_t out_features, int64_t in_features, int64_t begin, int64_t end) {
  const int64_t k = Width<K>::get(in_features);
  if (rows == 1) {
    for (int64_t n = begin; n < end; ++n)
      out[n] = scale ? dot<K>(x, w + n * k, k) * scale[n] : dot<K>(x, w + n * k, k);
    return;
  }
  int64_t n = begin;
  for (; n + 4 <= end; n += 4)
    rows_of<4, K>(x, rows, w + n * k, k, scale ? scale + n : nullptr, out + n, out_features);
  for (; n < end; ++n)
    rows_of<1, K>(x, rows, w + n * k, k, scale ? scale + n : nullptr, out + n, out_features);
}

template <typename W>
void features_any(const float* x, int64_t rows, const W* w, const float* scale, float* out,
                  int64_t out_features, int64_t in_features, int64_t begin, int64_t end) {
  switch (in_features) {  // the README model's widths, unrolled whole
    case 128: features<128>(x, rows, w, scale, out, out_features, in_features, begin, end); break;
    case 256: features<256>(x, rows, w, scale, out, out_features, in_features, begin, end); break;
    default: features<0>(x, rows, w, scale, out, out_features, in_features, begin, end);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// built for every AVX-512 machine, taken where the CPU has BF16 (Zen 4, Cooper Lake, Sapphire
// Rapids and later)
#define LATHE_DPBF16 __attribute__((target("avx512bf16,avx512bw,avx512f,avx512vl")))

bool has_avx512_bf16() {
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
}

// out[r, f] for R bf16 x rows and F bf16 weight rows, over k inputs
template <int R, int F>
LATHE_DPBF16 inline void tile_dpbf16(const uint16_t* x, const uint16_t* w, int64_t k,
                                     float* out, int64_t out_features) {
  __m512 acc[R][F];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int f = 0; f < F; ++f) acc[r][f] = _mm512_setzero_ps();
  const auto step = [&](int64_t i, __mmask32 mask) LATHE_DPBF16 {
    __m512i wv[F];
#pragma GCC unroll 4
    for (int f = 0; f < F; ++f) wv[f] = _mm512_maskz_loadu_epi16(mask, w + f * k + i);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + r * k + i);
#pragma GCC unroll 4
      for (int f = 0; f < F; ++f)
        acc[r][f] = _mm512_dpbf16_ps(acc[r][f], (__m512bh)xv, (__m512bh)wv[f]);
    }
  };
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) step(i, ~__mmask32(0));
  if (i < k) step(i, (__mmask32(1) << (k - i)) - 1);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int f = 0; f < F; ++f) out[r * out_features + f] = _mm512_reduce_add_ps(acc[r][f]);
}

template <int F>
LATHE_DPBF16 inline void rows_dpbf16(const uint16_t* x, int64_t rows, const uint16_t* w,
                                     int64_t k, float* out, int64_t out_features) {
  int64_t m = 0;
  for (; m + 4 <= rows; m += 4) tile_dpbf16<4, F>(x + m * k, w, k, out + m * out_features,
                                                  out_features);
  const uint16_t* xm = x + m * k;
  float* om = out + m * out_features;
  switch (rows - m) {
    case 3: tile_dpbf16<3, F>(xm, w, k, om, out_features); break;
    case 2: tile_dpbf16<2, F>(xm, w, k, om, out_features); break;
    case 1: tile_dpbf16<1, F>(xm, w, k, om, out_features); break;
    default: break;
  }
}

// `dot` for bf16 x and weight rows, 32 products an instruction
LATHE_DPBF16 inline float dot_dpbf16(const uint16_t* x, const uint16_t* w, int64_t k) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 128 <= k; i += 128) {
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u)
      acc[u] = _mm512_dpbf16_ps(acc[u], (__m512bh)_mm512_loadu_si512(x + i + 32 * u),
                                (__m512bh)_mm512_loadu_si512(w + i + 32 * u));
  }
  for (; i < k; i += 32) {
    const __mmask32 mask = k - i >= 32 ? ~__mmask32(0) : (__mmask32(1) << (k - i)) - 1;
    acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i),
                              (__m512bh)_mm512_maskz_loadu_epi16(mask, w + i));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]),
                                            _mm512_add_ps(acc[2], acc[3])));
}

LATHE_DPBF16 void features_dpbf16(const uint16_t* x, int64_t rows, const uint16_t* w, float* out,
                                  int64_t out_features, int64_t k, int64_t begin, int64_t end) {
  if (rows == 1) {
    for (int64_t n = begin; n < end; ++n) out[n] = dot_dpbf16(x, w + n * k, k);
    return;
  }
  int64_t n = begin;
  for (; n + 4 <= end; n += 4) rows_dpbf16<4>(x, rows, w + n * k, k, out + n, out_features);
  for (; n < end; ++n) rows_dpbf16<1>(x, rows, w + n * k, k, out + n, out_features);
}

#if defined(LATHE_WITH_AMX)
// AMX (Sapphire Rapids and later): a tile multiply takes 16 × 32 bf16 of one operand and
// 16 × 32 of the other, 16 × 16 × 32 products an instruction against AVX-512 BF16's 32, so
// from kAmxMinRows rows on a bf16 weight meets x there. The products are the same as
// `tile_dpbf16`'s (x rounded to bf16 once a call, float32 sums), so a prefill and a decode
// step still give the same numbers but for the order of the sums. Tiles are 16 rows of 64
// bytes: 16 weight rows × 32 inputs (the weight as it lies), and the second operand in the
// pairs layout AMX reads (`pack_pairs`), 16 input pairs × 16 x rows; each output tile is
// 16 features × 16 x rows, transposed on its way out.
#define LATHE_AMX __attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512bw,avx512f,avx512vl")))

constexpr int64_t kAmxMinRows = 16;
constexpr int64_t kAmxBlock = 32;  // features and x rows per block: 2 × 2 tiles of 16

// whether this process may use AMX tiles: the CPU has them and Linux granted the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, once, for every thread of the process)
bool has_amx_bf16() {
  static const bool yes = [] {
    unsigned eax, ebx, ecx, edx;  // CPUID 7.0: EDX bit 22 AMX-BF16, bit 24 AMX-TILE
    return __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx >> 22 & 1) &&
           (edx >> 24 & 1) &&
           syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                   18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return yes;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// x rows rounded up to whole blocks
inline int64_t padded_rows(int64_t rows) { return (rows + kAmxBlock - 1) / kAmxBlock * kAmxBlock; }

// x (rows, k) bf16 as AMX's second operand: pairs[k / 2][m][2], m padded with zeros to
// `padded_rows`
at::Tensor pack_pairs(const at::Tensor& x_bf16) {
  const int64_t rows = x_bf16.size(0), k = x_bf16.size(1);
  const int64_t padded = padded_rows(rows);
  at::Tensor pairs = at::zeros({k / 2, padded, 2}, x_bf16.options());
  pairs.narrow(1, 0, rows).copy_(x_bf16.view({rows, k / 2, 2}).transpose(0, 1));
  return pairs;
}

// out[:, n0 : n0 + kAmxBlock] for every x row: the weight's rows n0.. against `pairs`
LATHE_AMX void block_amx(const uint16_t* pairs, int64_t rows, int64_t padded,
                         const uint16_t* w, int64_t k, float* out, int64_t out_features,
                         int64_t n0) {
  alignas(64) float c[16 * 16];
  const int64_t w_stride = k * 2, x_stride = padded * 4;  // bytes a tile row
  const uint16_t* w0 = w + n0 * k;
  const uint16_t* w1 = w0 + 16 * k;
  for (int64_t m0 = 0; m0 < padded; m0 += kAmxBlock) {
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    for (int64_t i = 0; i < k; i += 32) {
      const uint16_t* x0 = pairs + (i / 2) * padded * 2 + m0 * 2;
      _tile_loadd(0, w0 + i, w_stride);
      _tile_loadd(1, w1 + i, w_stride);
      _tile_loadd(2, x0, x_stride);
      _tile_loadd(3, x0 + 32, x_stride);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(5, 0, 3);
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
    const auto spill = [&](int64_t features, int64_t xs) {  // c[f][m] to out[m][f]
      for (int64_t m = 0; m < 16 && xs + m < rows; ++m)
        for (int64_t f = 0; f < 16; ++f)
          out[(xs + m) * out_features + n0 + features + f] = c[f * 16 + m];
    };
    _tile_stored(4, c, 64); spill(0, m0);
    _tile_stored(5, c, 64); spill(0, m0 + 16);
    _tile_stored(6, c, 64); spill(16, m0);
    _tile_stored(7, c, 64); spill(16, m0 + 16);
  }
}

LATHE_AMX void features_amx(const uint16_t* pairs, const uint16_t* x, int64_t rows,
                            const uint16_t* w, float* out, int64_t out_features, int64_t k,
                            int64_t begin, int64_t end) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
  const int64_t padded = padded_rows(rows);
  int64_t n = begin;
  for (; n + kAmxBlock <= end; n += kAmxBlock)
    block_amx(pairs, rows, padded, w, k, out, out_features, n);
  _tile_release();
  if (n < end) features_dpbf16(x, rows, w, out, out_features, k, n, end);
}
#endif  // LATHE_WITH_AMX
#endif

// y_i = x · w_iᵀ (· scale_i) for every weight of `weights` (the linears of one decode step
// that read the same x: q, k and v; gate and up) in one parallel loop over all their output
// features: a compiled graph pays the dispatcher and the thread pool once for the group.
// `scales` is empty for float32 weights, else one float32 vector per int8 weight.
std::vector<at::Tensor> linears(const char* op, const at::Tensor& x_in,
                                at::TensorList weights_in, at::TensorList scales_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, op,
              ": x must be float32 (rows, in_features), got ", x_in.scalar_type(), " ",
              x_in.sizes());
  const bool quantized = !scales_in.empty();
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), in_features = x.size(1);
  std::vector<at::Tensor> weights, scales, outs;
  std::vector<int64_t> starts{0};  // where each weight's features begin in the joint range
  const at::ScalarType kind = quantized ? at::kChar
                              : weights_in.empty() ? at::kFloat : weights_in[0].scalar_type();
  TORCH_CHECK(quantized || kind == at::kFloat || kind == at::kBFloat16 || kind == at::kHalf,
              op, ": takes float32, bfloat16 or float16 weights, got ", kind);
  for (size_t i = 0; i < weights_in.size(); ++i) {
    const at::Tensor& weight = weights_in[i];
    TORCH_CHECK(weight.dim() == 2 && weight.size(1) == in_features, op,
                ": each weight must be (out_features, ", in_features, "), got ",
                weight.sizes());
    TORCH_CHECK(!quantized || weight.scalar_type() == kind, op, ": takes int8 weights, got ",
                weight.scalar_type());
    TORCH_CHECK(weight.scalar_type() == kind, op, ": takes float32, bfloat16 or float16 "
                "weights, all of one dtype; got ", weight.scalar_type(), " after ", kind);
    if (quantized) {
      const at::Tensor& scale = scales_in[i];
      TORCH_CHECK(scale.dim() == 1 && scale.size(0) == weight.size(0) &&
                      scale.scalar_type() == at::kFloat,
                  op, ": each scale must be float32 (out_features,) = (", weight.size(0),
                  ",), got ", scale.scalar_type(), " ", scale.sizes());
      scales.push_back(scale.contiguous());
    }
    weights.push_back(weight.contiguous());
    outs.push_back(at::empty({rows, weight.size(0)}, x.options()));
    starts.push_back(starts.back() + weight.size(0));
  }
  const float* x_data = x.data_ptr<float>();
#if defined(CPU_CAPABILITY_AVX512)
  const bool dpbf16 = kind == at::kBFloat16 && has_avx512_bf16();
#else
  const bool dpbf16 = false;
#endif
  const at::Tensor x_bf16 = dpbf16 ? x.to(at::kBFloat16) : at::Tensor();
#if defined(LATHE_WITH_AMX)
  const bool amx = dpbf16 && rows >= kAmxMinRows && in_features % 32 == 0 && has_amx_bf16();
  const at::Tensor pairs = amx ? pack_pairs(x_bf16) : at::Tensor();
  if (amx) {  // tasks of whole blocks of each weight's features
    std::vector<int64_t> first{0};  // each weight's first block in the joint range
    for (const at::Tensor& weight : weights)
      first.push_back(first.back() + (weight.size(0) + kAmxBlock - 1) / kAmxBlock);
    at::parallel_for(0, first.back(), 1, [&](int64_t begin, int64_t end) {
      for (size_t i = 0; i < weights.size(); ++i) {
        const int64_t lo = std::max(begin, first[i]) - first[i];
        const int64_t hi = std::min(end, first[i + 1]) - first[i];
        if (lo >= hi) continue;
        const int64_t out_features = weights[i].size(0);
        features_amx(static_cast<const uint16_t*>(pairs.data_ptr()),
                     static_cast<const uint16_t*>(x_bf16.data_ptr()), rows,
                     static_cast<const uint16_t*>(weights[i].data_ptr()),
                     outs[i].data_ptr<float>(), out_features, in_features, lo * kAmxBlock,
                     std::min(hi * kAmxBlock, out_features));
      }
    });
    return outs;
  }
#endif
  // ~32K multiply-adds a task at least: a small layer stays on one thread
  const int64_t grain = std::max<int64_t>(64, 32768 / std::max<int64_t>(1, in_features * rows));
  at::parallel_for(0, starts.back(), grain, [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < weights.size(); ++i) {
      const int64_t lo = std::max(begin, starts[i]) - starts[i];
      const int64_t hi = std::min(end, starts[i + 1]) - starts[i];
      if (lo >= hi) continue;
      float* out = outs[i].data_ptr<float>();
      const int64_t out_features = weights[i].size(0);
      const void* w = weights[i].data_ptr();
      const float* scale = quantized ? scales[i].data_ptr<float>() : nullptr;
      switch (kind) {
        case at::kChar:
          features_any(x_data, rows, static_cast<const int8_t*>(w), scale, out, out_features,
                       in_features, lo, hi);
          break;
        case at::kBFloat16:
#if defined(CPU_CAPABILITY_AVX512)
          if (dpbf16) {
            features_dpbf16(static_cast<const uint16_t*>(x_bf16.data_ptr()), rows,
                            static_cast<const uint16_t*>(w), out, out_features, in_features, lo,
                            hi);
            break;
          }
#endif
          features_any(x_data, rows, static_cast<const at::BFloat16*>(w), scale, out,
                       out_features, in_features, lo, hi);
          break;
        case at::kHalf:
          features_any(x_data, rows, static_cast<const at::Half*>(w), scale, out, out_features,
                       in_features, lo, hi);
          break;
        default:
          features_any(x_data, rows, static_cast<const float*>(w), scale, out, out_features,
                       in_features, lo, hi);
      }
    }
  });
  return outs;
}

// one op per group size: inductor's C++ wrapper calls an op with a Tensor[] argument back
// through Python, and one of fixed tensor arguments directly
at::Tensor decode_linear_cpu(const at::Tensor& x, const at::Tensor& w) {
  return linears("decode_linear_cpu", x, {w}, {})[0];
}

std::tuple<at::Tensor, at::Tensor> decode_linear2_cpu(const at::Tensor& x, const at::Tensor& w0,
                                                      const at::Tensor& w1) {
  std::vector<at::Tensor> y = linears("decode_linear2_cpu", x, {w0, w1}, {});
  return {y[0], y[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_linear3_cpu(
    const at::Tensor& x, const at::Tensor& w0, const at::Tensor& w1, const at::Tensor& w2) {
  std::vector<at::Tensor> y = linears("decode_linear3_cpu", x, {w0, w1, w2}, {});
  return {y[0], y[1], y[2]};
}

at::Tensor decode_linear_int8_cpu(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s) {
  return linears("decode_linear_int8_cpu", x, {q}, {s})[0];
}

std::tuple<at::Tensor, at::Tensor> decode_linear_int8_2_cpu(
    const at::Tensor& x, const at::Tensor& q0, const at::Tensor& s0, const at::Tensor& q1,
    const at::Tensor& s1) {
  std::vector<at::Tensor> y = linears("decode_linear_int8_2_cpu", x, {q0, q1}, {s0, s1});
  return {y[0], y[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_linear_int8_3_cpu(
    const at::Tensor& x, const at::Tensor& q0, const at::Tensor& s0, const at::Tensor& q1,
    const at::Tensor& s1, const at::Tensor& q2, const at::Tensor& s2) {
  std::vector<at::Tensor> y =
      linears("decode_linear_int8_3_cpu", x, {q0, q1, q2}, {s0, s1, s2});
  return {y[0], y[1], y[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(lathe, CPU, m) {
  m.impl("decode_linear_cpu", &decode_linear_cpu);
  m.impl("decode_linear2_cpu", &decode_linear2_cpu);
  m.impl("decode_linear3_cpu", &decode_linear3_cpu);
  m.impl("decode_linear_int8_cpu", &decode_linear_int8_cpu);
  m.impl("decode_linear_int8_2_cpu", &decode_linear_int8_2_cpu);
  m.impl("decode_linear_int8_3_cpu", &decode_linear_int8_3_cpu);
}
