// Which of torch's intra-op threads ran each item of a parallel loop: the implementation of
// `lathe::parallel_probe_cpu` (schema in lathe/kernels/cpu_native.py). `at::parallel_for`
// is an OpenMP loop written in ATen's headers: code compiled without OpenMP gets a serial
// loop and no error, so the loader asks this op whether the library's loops run on more
// than one thread.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace {

at::Tensor parallel_probe_cpu(const at::Tensor& items) {
  at::Tensor owners = at::empty({items.numel()}, items.options().dtype(at::kLong));
  int64_t* data = owners.data_ptr<int64_t>();
  at::parallel_for(0, items.numel(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) data[i] = at::get_thread_num();
  });
  return owners;
}

}  // namespace

TORCH_LIBRARY_IMPL(lathe, CPU, m) {
  m.impl("parallel_probe_cpu", &parallel_probe_cpu);
}
