// Each row's own LoRA adapter added to a projection's output, for a float32 decode step on
// CPU: out[n] = y[n] + scale[s] · (x[n] · A[s]) · B[s] where s = row_slots[n], and
// out[n] = y[n] for a row of the base model (s = -1) — Punica's BGMV. The implementation of
// `lathe::lora_bgmv_cpu` (schema, fake and dispatch in lathe/kernels/lora_bgmv.py). A
// compiled decode step with adapter slots had traced this as gathers, batched matmuls and
// masks in every projection of every layer, which inductor then scheduled and compiled as
// kernels of their own: the step's graphs took 2.6-4.4× as long to build as the base's.
// Here the whole delta is one call. A row reads only its own slot's A (in × rank) and B
// (rank × out): another slot's NaN never reaches it. Rows are taken in order of their slot,
// so the rows of one adapter read its weights from cache, and split over torch's intra-op
// threads; the two products are streams over A's and B's rows (one rank-wide and one
// out-wide vector at a time), which -O3 -ffast-math vectorizes for the library's ISA.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// a task of this many multiply-adds or more: below it a thread's wake-up costs more
constexpr int64_t kGrainWork = 65536;

void check_float(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == dim,
              "lora_bgmv_cpu: ", name, " must be a ", dim, "-d float32 CPU tensor, got ",
              t.dim(), "-d ", t.scalar_type(), " on ", t.device());
}

at::Tensor lora_bgmv_cpu(const at::Tensor& y_in, const at::Tensor& x_in,
                         const at::Tensor& a_in, const at::Tensor& b_in,
                         const at::Tensor& scale_in, const at::Tensor& row_slots_in) {
  check_float(y_in, "y", 2);
  check_float(x_in, "x", 2);
  check_float(a_in, "lora_a", 3);
  check_float(b_in, "lora_b", 3);
  check_float(scale_in, "scale", 1);
  const int64_t rows = x_in.size(0), in = x_in.size(1), out_features = y_in.size(1);
  const int64_t slots = a_in.size(0), rank = a_in.size(2);
  TORCH_CHECK(y_in.size(0) == rows, "lora_bgmv_cpu: y has ", y_in.size(0), " rows, x ", rows);
  TORCH_CHECK(a_in.size(1) == in && b_in.size(0) == slots && b_in.size(1) == rank &&
                  b_in.size(2) == out_features && scale_in.size(0) == slots,
              "lora_bgmv_cpu: lora_a ", a_in.sizes(), ", lora_b ", b_in.sizes(), " and scale ",
              scale_in.sizes(), " must be (slots, in=", in, ", rank), (slots, rank, out=",
              out_features, ") and (slots)");
  TORCH_CHECK(row_slots_in.device().is_cpu() && row_slots_in.scalar_type() == at::kLong &&
                  row_slots_in.dim() == 1 && row_slots_in.size(0) >= rows,
              "lora_bgmv_cpu: row_slots must be an int64 CPU vector of at least ", rows,
              " entries, got ", row_slots_in.sizes(), " ", row_slots_in.scalar_type());
  const at::Tensor y = y_in.contiguous(), x = x_in.contiguous(), a = a_in.contiguous();
  const at::Tensor b = b_in.contiguous(), scale = scale_in.contiguous();
  const at::Tensor row_slots = row_slots_in.contiguous();
  const int64_t* slot_of = row_slots.data_ptr<int64_t>();

  // the rows grouped by slot (a counting sort; base rows first)
  std::vector<int64_t> counts(slots + 2, 0);
  for (int64_t n = 0; n < rows; ++n) {
    const int64_t s = slot_of[n];
    TORCH_CHECK(s >= -1 && s < slots, "lora_bgmv_cpu: row ", n, " names slot ", s,
                " of ", slots);
    ++counts[s + 2];
  }
  for (int64_t s = 1; s < slots + 2; ++s) counts[s] += counts[s - 1];
  std::vector<int64_t> order(rows);
  for (int64_t n = 0; n < rows; ++n) order[counts[slot_of[n] + 1]++] = n;

  at::Tensor out = at::empty_like(y);
  const float *x_p = x.data_ptr<float>(), *y_p = y.data_ptr<float>();
  const float *a_p = a.data_ptr<float>(), *b_p = b.data_ptr<float>();
  const float* scale_p = scale.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrainWork / std::max<int64_t>(
                                                 1, rank * (in + out_features)));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> h(rank);
    for (int64_t k = begin; k < end; ++k) {
      const int64_t n = order[k], s = slot_of[n];
      float* o = out_p + n * out_features;
      std::memcpy(o, y_p + n * out_features, out_features * sizeof(float));
      if (s < 0) continue;
      const float* xn = x_p + n * in;
      const float* as = a_p + s * in * rank;
      std::fill(h.begin(), h.end(), 0.f);
      for (int64_t i = 0; i < in; ++i) {
        const float xi = xn[i];
        const float* ai = as + i * rank;
        for (int64_t r = 0; r < rank; ++r) h[r] += xi * ai[r];
      }
      const float* bs = b_p + s * rank * out_features;
      const float c = scale_p[s];
      for (int64_t r = 0; r < rank; ++r) {
        const float hr = h[r] * c;
        const float* br = bs + r * out_features;
        for (int64_t j = 0; j < out_features; ++j) o[j] += hr * br[j];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(lathe, CPU, m) {
  m.impl("lora_bgmv_cpu", &lora_bgmv_cpu);
}
