// y = x · wᵀ for the few rows of a decode step on CPU: the implementation of
// `lathe::decode_linear_cpu` (schema, fake and the graph pass that calls it in
// lathe/kernels/decode_linear.py). At a few rows, BLAS's GEMM pays a fixed cost per call
// that is most of the time for a small model's layers, and streams a large weight (the LM
// head) at a fraction of the rate two cores can read it. Here each task takes a range of output
// features, four weight rows at a time (so the x rows are reused from registers and each
// weight row is read once for all M rows), with the dot products vectorized by the compiler
// (-ffast-math lets it reorder the sums).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

template <int K>
struct Width {
  static constexpr int64_t get(int64_t) { return K; }
};
template <>
struct Width<0> {  // in_features known only at run time
  static int64_t get(int64_t k) { return k; }
};

template <int K>
void features(const float* x, int64_t rows, const float* w, float* out, int64_t out_features,
              int64_t in_features, int64_t begin, int64_t end) {
  const int64_t k = Width<K>::get(in_features);
  int64_t n = begin;
  for (; n + 4 <= end; n += 4) {
    const float* w0 = w + n * k;
    const float* w1 = w0 + k;
    const float* w2 = w1 + k;
    const float* w3 = w2 + k;
    for (int64_t m = 0; m < rows; ++m) {
      const float* xm = x + m * k;
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
      for (int64_t i = 0; i < k; ++i) {
        a0 += xm[i] * w0[i];
        a1 += xm[i] * w1[i];
        a2 += xm[i] * w2[i];
        a3 += xm[i] * w3[i];
      }
      float* o = out + m * out_features + n;
      o[0] = a0;
      o[1] = a1;
      o[2] = a2;
      o[3] = a3;
    }
  }
  for (; n < end; ++n) {
    const float* wn = w + n * k;
    for (int64_t m = 0; m < rows; ++m) {
      const float* xm = x + m * k;
      float a = 0.f;
      for (int64_t i = 0; i < k; ++i) a += xm[i] * wn[i];
      out[m * out_features + n] = a;
    }
  }
}

at::Tensor decode_linear_cpu(const at::Tensor& x_in, const at::Tensor& weight_in) {
  TORCH_CHECK(x_in.dim() == 2 && weight_in.dim() == 2 && x_in.size(1) == weight_in.size(1),
              "decode_linear_cpu: x must be (rows, in_features) and weight (out_features, "
              "in_features), got ", x_in.sizes(), " and ", weight_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && weight_in.scalar_type() == at::kFloat,
              "decode_linear_cpu: takes float32 x and weight");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const int64_t rows = x.size(0), out_features = weight.size(0), in_features = weight.size(1);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  const float* x_data = x.data_ptr<float>();
  const float* w_data = weight.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  // ~32K multiply-adds a task at least: a small layer stays on one thread
  const int64_t grain = std::max<int64_t>(64, 32768 / std::max<int64_t>(1, in_features * rows));
  at::parallel_for(0, out_features, grain, [&](int64_t begin, int64_t end) {
    switch (in_features) {
      case 128: return features<128>(x_data, rows, w_data, out_data, out_features, in_features, begin, end);
      case 256: return features<256>(x_data, rows, w_data, out_data, out_features, in_features, begin, end);
      default: return features<0>(x_data, rows, w_data, out_data, out_features, in_features, begin, end);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(lathe, CPU, m) {
  m.impl("decode_linear_cpu", &decode_linear_cpu);
}
