// torch's CPU weight-only GEMMs as the ops `lathe::int8_matmul_cpu_native` and
// `lathe::int4_matmul_cpu_native` (schemas and fakes in lathe/kernels/quant_matmul.py),
// which a compiled decode step calls once per linear. The same ops written in Python cost
// ~4 µs of interpreter a call, 29 calls a step of the README model: more than the int8
// weights save. Inside, operands are made contiguous and 64-byte aligned, since the GEMMs
// crash on unaligned data (a weight viewed straight out of a safetensors file).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

namespace {

at::Tensor aligned(const at::Tensor& t) {
  at::Tensor dense = t.contiguous();
  return reinterpret_cast<std::uintptr_t>(dense.data_ptr()) % 64 == 0 ? dense : dense.clone();
}

at::Tensor int8_matmul_cpu_native(const at::Tensor& x2, const at::Tensor& q,
                                  const at::Tensor& scale) {
  return at::_weight_int8pack_mm(aligned(x2), aligned(q), scale);
}

at::Tensor int4_matmul_cpu_native(const at::Tensor& x2, const at::Tensor& weight,
                                  const at::Tensor& scales_zeros) {
  TORCH_CHECK(scales_zeros.dim() == 3 && x2.size(-1) % scales_zeros.size(0) == 0,
              "int4_matmul_cpu_native: scales_zeros must be (groups, out_features, 2) with "
              "groups dividing in_features ", x2.size(-1), ", got ", scales_zeros.sizes());
  const int64_t group = x2.size(-1) / scales_zeros.size(0);
  return at::_weight_int4pack_mm_for_cpu(aligned(x2), weight, group, scales_zeros);
}

}  // namespace

TORCH_LIBRARY_IMPL(lathe, CPU, m) {
  m.impl("int8_matmul_cpu_native", &int8_matmul_cpu_native);
  m.impl("int4_matmul_cpu_native", &int4_matmul_cpu_native);
}
