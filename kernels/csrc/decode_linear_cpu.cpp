// y_i = x · w_iᵀ, for the few rows of a decode step on CPU and one or more weights that read
// the same x: the implementation of `lathe::decode_linear_cpu` (schema, fake and the graph
// pass that calls it in lathe/kernels/decode_linear.py). At a few rows, BLAS's GEMM pays a
// fixed cost per call that is most of the time for a small model's layers, and streams a
// large weight (the LM head) at a fraction of the rate two cores can read it. Here each task
// takes a range of output features, four weight rows at a time (so the x rows are reused
// from registers and each weight row is read once for all M rows), with the dot products
// vectorized by the compiler (-ffast-math lets it reorder the sums).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

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

// y_i = x · w_iᵀ for every weight of `weights` (the linears of one decode step that read the
// same x: q, k and v; gate and up) in one parallel loop over all their output features: a
// compiled graph pays the dispatcher and the thread pool once for the group.
std::vector<at::Tensor> linears(const at::Tensor& x_in, at::TensorList weights_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat,
              "decode_linear_cpu: x must be float32 (rows, in_features), got ",
              x_in.scalar_type(), " ", x_in.sizes());
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), in_features = x.size(1);
  std::vector<at::Tensor> weights, outs;
  std::vector<int64_t> starts{0};  // where each weight's features begin in the joint range
  for (const at::Tensor& weight : weights_in) {
    TORCH_CHECK(weight.dim() == 2 && weight.size(1) == in_features,
                "decode_linear_cpu: each weight must be (out_features, ", in_features,
                "), got ", weight.sizes());
    TORCH_CHECK(weight.scalar_type() == at::kFloat,
                "decode_linear_cpu: takes float32 weights, got ", weight.scalar_type());
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
      const float* w = weights[i].data_ptr<float>();
      float* out = outs[i].data_ptr<float>();
      const int64_t out_features = weights[i].size(0);
      switch (in_features) {
        case 128: features<128>(x_data, rows, w, out, out_features, in_features, lo, hi); break;
        case 256: features<256>(x_data, rows, w, out, out_features, in_features, lo, hi); break;
        default: features<0>(x_data, rows, w, out, out_features, in_features, lo, hi);
      }
    }
  });
  return outs;
}

// one op per group size: inductor's C++ wrapper calls an op with a Tensor[] argument back
// through Python, and one of fixed tensor arguments directly
at::Tensor decode_linear_cpu(const at::Tensor& x, const at::Tensor& w) {
  return linears(x, {w})[0];
}

std::tuple<at::Tensor, at::Tensor> decode_linear2_cpu(const at::Tensor& x, const at::Tensor& w0,
                                                      const at::Tensor& w1) {
  std::vector<at::Tensor> y = linears(x, {w0, w1});
  return {y[0], y[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_linear3_cpu(
    const at::Tensor& x, const at::Tensor& w0, const at::Tensor& w1, const at::Tensor& w2) {
  std::vector<at::Tensor> y = linears(x, {w0, w1, w2});
  return {y[0], y[1], y[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(lathe, CPU, m) {
  m.impl("decode_linear_cpu", &decode_linear_cpu);
  m.impl("decode_linear2_cpu", &decode_linear2_cpu);
  m.impl("decode_linear3_cpu", &decode_linear3_cpu);
}
