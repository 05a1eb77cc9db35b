// y_i = x · w_iᵀ (· scale_i), for the few rows of a decode step on CPU and one or more
// weights that read the same x: the implementations of `lathe::decode_linear_cpu` (float32
// weights) and `lathe::decode_linear_int8_cpu` (int8 weights with a float32 scale per output
// feature, serving's weight-only int8), whose schemas, fakes and graph pass are in
// lathe/kernels/decode_linear.py. At a few rows, BLAS's GEMM pays a fixed cost per call that
// is most of the time for a small model's layers, and streams a large weight (the LM head)
// at a fraction of the rate two cores can read it; torch's int8 GEMM takes bf16 rows and
// pays the same fixed cost. Here each task takes a range of output features, four weight
// rows at a time, against one x row (float32) or four (int8): each weight vector is loaded
// (and, for int8, widened to float) once for the tile's rows, and each x vector once for the
// four features, into register sums that are reduced only at the end.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

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
// at a time (tiles of four took 5-15% longer at 4-32 rows); an int8 one costs a load and two
// conversions, which a tile of four rows shares (16 × 128 → 4096: 134 µs, against 207 µs
// in tiles of one)
template <typename W>
constexpr int kTileRows = 1;
template <>
constexpr int kTileRows<int8_t> = 4;

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

template <int K, typename W>
void features(const float* x, int64_t rows, const W* w, const float* scale, float* out,
              int64_t out_features, int64_t in_features, int64_t begin, int64_t end) {
  const int64_t k = Width<K>::get(in_features);
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
  for (size_t i = 0; i < weights_in.size(); ++i) {
    const at::Tensor& weight = weights_in[i];
    TORCH_CHECK(weight.dim() == 2 && weight.size(1) == in_features, op,
                ": each weight must be (out_features, ", in_features, "), got ",
                weight.sizes());
    TORCH_CHECK(weight.scalar_type() == (quantized ? at::kChar : at::kFloat), op, ": takes ",
                quantized ? "int8" : "float32", " weights, got ", weight.scalar_type());
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
  // ~32K multiply-adds a task at least: a small layer stays on one thread
  const int64_t grain = std::max<int64_t>(64, 32768 / std::max<int64_t>(1, in_features * rows));
  at::parallel_for(0, starts.back(), grain, [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < weights.size(); ++i) {
      const int64_t lo = std::max(begin, starts[i]) - starts[i];
      const int64_t hi = std::min(end, starts[i + 1]) - starts[i];
      if (lo >= hi) continue;
      float* out = outs[i].data_ptr<float>();
      const int64_t out_features = weights[i].size(0);
      if (quantized)
        features_any(x_data, rows, weights[i].data_ptr<int8_t>(), scales[i].data_ptr<float>(),
                     out, out_features, in_features, lo, hi);
      else
        features_any(x_data, rows, weights[i].data_ptr<float>(), nullptr, out, out_features,
                     in_features, lo, hi);
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
