// The element-wise layers of a float32 forward on CPU, one pass over memory each:
// `lathe::rms_norm_cpu`, `lathe::add_rms_norm_cpu`, `lathe::swiglu_cpu` and
// `lathe::rope_cpu` (schemas, fakes and dispatch beside their Triton kernels and PyTorch
// references in lathe/kernels/rmsnorm.py, swiglu.py and rope.py). An eager forward runs
// each of them as 3–6 ATen ops, each with a temporary and a walk over the activations;
// the serve bench's 1,440-token prefill step took ~21.8 ms that way and ~20.2 ms with
// these. The norms' loops are plain C++, which -O3 -ffast-math vectorizes for the
// library's ISA; SwiGLU's and RoPE's are written with ATen's `Vectorized`. Rows (or chunks
// of elements) are split over torch's intra-op threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

// rows of this many elements or more make one task: below it a thread's wake-up costs
// more than the work
constexpr int64_t kGrainElements = 16384;

int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, kGrainElements / cols); }

void check_float(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, op, ": ", name,
              " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  check_float(x, op, "x");
  check_float(weight, op, "weight");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), op,
              ": weight must be (", x.size(-1), "), the last dimension of x, got ",
              weight.sizes());
}

// y = x / sqrt(mean(x²) + eps) · w over one row, as the reference orders it: normalize
// in float32, then scale by the weight
inline void normalize_row(const float* x, const float* w, float* y, int64_t cols, float eps) {
  float squares = 0.f;
  for (int64_t i = 0; i < cols; ++i) squares += x[i] * x[i];
  const float rstd = 1.f / std::sqrt(squares / static_cast<float>(cols) + eps);
  for (int64_t i = 0; i < cols; ++i) y[i] = w[i] * (x[i] * rstd);
}

at::Tensor rms_norm_cpu(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check_norm_args(x_in, weight_in, "rms_norm_cpu");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  at::Tensor y = at::empty_like(x);
  const int64_t cols = x.size(-1);
  const int64_t rows = cols ? x.numel() / cols : 0;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      normalize_row(xp + r * cols, wp, yp + r * cols, cols, static_cast<float>(eps));
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x_in,
                                                    const at::Tensor& residual_in,
                                                    const at::Tensor& weight_in, double eps) {
  check_norm_args(x_in, weight_in, "add_rms_norm_cpu");
  check_float(residual_in, "add_rms_norm_cpu", "residual");
  TORCH_CHECK(residual_in.sizes() == x_in.sizes(), "add_rms_norm_cpu: residual must be ",
              x_in.sizes(), " as x is, got ", residual_in.sizes());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor residual = residual_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  at::Tensor y = at::empty_like(x);
  at::Tensor total = at::empty_like(x);
  const int64_t cols = x.size(-1);
  const int64_t rows = cols ? x.numel() / cols : 0;
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* tp = total.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t offset = r * cols;
      for (int64_t i = 0; i < cols; ++i) tp[offset + i] = xp[offset + i] + rp[offset + i];
      normalize_row(tp + offset, wp, yp + offset, cols, static_cast<float>(eps));
    }
  });
  return {y, total};
}

at::Tensor swiglu_cpu(const at::Tensor& gate_in, const at::Tensor& up_in) {
  check_float(gate_in, "swiglu_cpu", "gate");
  check_float(up_in, "swiglu_cpu", "up");
  TORCH_CHECK(gate_in.sizes() == up_in.sizes(), "swiglu_cpu: up must be ", gate_in.sizes(),
              " as gate is, got ", up_in.sizes());
  const at::Tensor gate = gate_in.contiguous();
  const at::Tensor up = up_in.contiguous();
  at::Tensor y = at::empty_like(gate);
  const float* gp = gate.data_ptr<float>();
  const float* up_p = up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // ATen's polynomial exp (inductor's), on an argument clamped to ±80, where the sigmoid
  // is 0 or 1 to float precision: libmvec's vector expf, which `std::exp` becomes, hands
  // every lane past ±88 to the scalar expf (a tensor of such gates took 16× longer), and
  // the polynomial answers NaN there
  at::parallel_for(0, gate.numel(), kGrainElements, [&](int64_t begin, int64_t end) {
    const Vec one(1.f), low(-80.f), high(80.f);
    for (int64_t i = begin; i < end; i += kLanes) {
      const int64_t count = std::min(kLanes, end - i);
      const Vec g = Vec::loadu(gp + i, count);
      const Vec decay = at::vec::clamp(g.neg(), low, high).exp_u20();
      (g / (one + decay) * Vec::loadu(up_p + i, count)).store(yp + i, count);
    }
  });
  return y;
}

// one row in the rotate-half layout: x1·cos − x2·sin, then x2·cos + x1·sin
inline void rotate_row(const float* in, const float* c, const float* s, float* out,
                       int64_t half) {
  for (int64_t i = 0; i < half; i += kLanes) {
    const int64_t n = std::min(kLanes, half - i);
    const Vec x1 = Vec::loadu(in + i, n), x2 = Vec::loadu(in + half + i, n);
    (x1 * Vec::loadu(c + i, n) - x2 * Vec::loadu(s + i, n)).store(out + i, n);
    (x2 * Vec::loadu(c + half + i, n) + x1 * Vec::loadu(s + half + i, n))
        .store(out + half + i, n);
  }
}

// x (B, H, T, D), any strides but a contiguous last dimension, rotated by cos/sin (B or 1,
// T, D) in the rotate-half layout: dimension i pairs with i + D/2. The result is
// contiguous.
at::Tensor rope_cpu(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  check_float(x_in, "rope_cpu", "x");
  check_float(cos_in, "rope_cpu", "cos");
  check_float(sin_in, "rope_cpu", "sin");
  TORCH_CHECK(x_in.dim() == 4 && x_in.size(3) % 2 == 0, "rope_cpu: x must be (B, H, T, D) "
              "with an even D, got ", x_in.sizes());
  const int64_t batch = x_in.size(0), heads = x_in.size(1), seq = x_in.size(2),
                dim = x_in.size(3), half = dim / 2;
  for (const at::Tensor* table : {&cos_in, &sin_in})
    TORCH_CHECK(table->dim() == 3 && (table->size(0) == batch || table->size(0) == 1) &&
                    table->size(1) == seq && table->size(2) == dim,
                "rope_cpu: cos and sin must be (", batch, " or 1, ", seq, ", ", dim,
                "), got ", table->sizes());
  const at::Tensor x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();
  const at::Tensor cos = cos_in.contiguous();
  const at::Tensor sin = sin_in.contiguous();
  at::Tensor y = at::empty({batch, heads, seq, dim}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t sb = x.stride(0), sh = x.stride(1), st = x.stride(2);
  const int64_t table_batch = cos.size(0) == 1 ? 0 : seq * dim;
  at::parallel_for(0, batch * heads * seq, grain_rows(dim), [&](int64_t begin, int64_t end) {
    // the row's (b, h, t), divided out once a task and stepped after: three 64-bit
    // divisions a row had cost more than its 32-element rotation
    int64_t t = begin % seq, h = (begin / seq) % heads, b = begin / (seq * heads);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t table = b * table_batch + t * dim;
      rotate_row(xp + b * sb + h * sh + t * st, cp + table, sp + table, yp + r * dim, half);
      if (++t == seq) {
        t = 0;
        if (++h == heads) h = 0, ++b;
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(lathe, CPU, m) {
  m.impl("rms_norm_cpu", &rms_norm_cpu);
  m.impl("add_rms_norm_cpu", &add_rms_norm_cpu);
  m.impl("swiglu_cpu", &swiglu_cpu);
  m.impl("rope_cpu", &rope_cpu);
}
