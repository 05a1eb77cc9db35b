// Decode attention over the serve engine's paged KV slabs, on CPU: the implementation of
// `lathe::paged_decode_cpu` (schema and fake defined in lathe/kernels/paged_attention.py).
//
// One task per (sequence, KV head) reads the sequence's blocks in place through its block
// table — no gathered copy of the context — scores every query head of the KV group
// against each key row while it is in cache, takes an exact two-pass softmax over the
// scores, and sums the value rows into registers. The dot products and sums are written
// with ATen's `Vectorized<float>` (the vector ISA the library is built for); -ffast-math
// turns `expf` over a score row into glibc's vector exp (libmvec). No infinities are used
// (rows past a context's length are never read).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

template <int D>
struct Dim {
  static constexpr int64_t get(int64_t) { return D; }
};
template <>
struct Dim<0> {  // the head size known only at run time
  static int64_t get(int64_t d) { return d; }
};

// A task reads a D-element slice of each slab row, and rows are n_kv_heads · D apart: two
// reads per page at most, too few for the hardware prefetcher to follow, so a context that
// is not in cache would be read at memory latency, not bandwidth. Rows this far ahead are
// prefetched instead.
constexpr int64_t kPrefetchRows = 8;

template <typename T>
inline void prefetch_row(const T* row, int64_t dim) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < dim * static_cast<int64_t>(sizeof(T)); offset += 64)
    __builtin_prefetch(bytes + offset);
}

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
// pass 2 sums a head's output this many vectors at a time, in registers
constexpr int64_t kChunkVecs = 4;

// `count` (<= kLanes) floats from `data`, zero-filled past them
inline Vec load(const float* data, int64_t count) {
  return count == kLanes ? Vec::loadu(data) : Vec::loadu(data, count);
}

// `count` slab elements as float: the slab's own for float slabs, else converted into
// `buffer`
template <typename T>
inline const float* as_float(const T* row, int64_t count, float* buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    for (int64_t d = 0; d < count; ++d) buffer[d] = static_cast<float>(row[d]);
    return buffer;
  }
}

template <int D, typename T>
void attend_group(const float* q, const T* k, const T* v, const int64_t* offsets,
                  int64_t length, int64_t group, int64_t head_dim, float* scores,
                  float* totals, float* row_buffer, float* out) {
  const int64_t dim = Dim<D>::get(head_dim);
  // pass 1: scores[g][t] = q_g . k_t (q already scaled); one key row serves the group
  for (int64_t t = 0; t < length; ++t) {
    if (t + kPrefetchRows < length) prefetch_row(k + offsets[t + kPrefetchRows], dim);
    const float* key = as_float(k + offsets[t], dim, row_buffer);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * dim;
      Vec dot(0.f);
      for (int64_t d = 0; d < dim; d += kLanes) {
        const int64_t count = std::min(kLanes, dim - d);
        dot = at::vec::fmadd(load(qg + d, count), load(key + d, count), dot);
      }
      scores[g * length + t] = at::vec::vec_reduce_all<float>(
          [](Vec& a, Vec& b) { return a + b; }, dot);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * length;
    float top = -FLT_MAX;
    for (int64_t t = 0; t < length; ++t) top = std::max(top, row[t]);
    float total = 0.f;
    for (int64_t t = 0; t < length; ++t) {
      row[t] = expf(row[t] - top);
      total += row[t];
    }
    totals[g] = total;
  }
  // pass 2: out[g] = sum_t p[g][t] v_t / total[g], kChunkVecs vectors of it at a time with
  // the sums in registers (the value rows come from cache after the first head and chunk)
  for (int64_t g = 0; g < group; ++g) {
    const float* p = scores + g * length;
    for (int64_t c = 0; c < dim; c += kChunkVecs * kLanes) {
      const int64_t width = std::min(kChunkVecs * kLanes, dim - c);
      Vec acc[kChunkVecs];
#pragma GCC unroll 4
      for (int64_t j = 0; j < kChunkVecs; ++j) acc[j] = Vec(0.f);
      for (int64_t t = 0; t < length; ++t) {
        if (g == 0 && c == 0 && t + kPrefetchRows < length)
          prefetch_row(v + offsets[t + kPrefetchRows], dim);
        const float* value = as_float(v + offsets[t] + c, width, row_buffer);
        const Vec weight(p[t]);
#pragma GCC unroll 4
        for (int64_t j = 0; j < kChunkVecs; ++j)
          if (j * kLanes < width)
            acc[j] = at::vec::fmadd(weight, load(value + j * kLanes,
                                                 std::min(kLanes, width - j * kLanes)), acc[j]);
      }
      const Vec inverse(1.f / totals[g]);
#pragma GCC unroll 4
      for (int64_t j = 0; j < kChunkVecs; ++j)
        if (j * kLanes < width)
          (acc[j] * inverse).store(out + g * dim + c + j * kLanes,
                                   std::min(kLanes, width - j * kLanes));
    }
  }
}

template <int D, typename T>
void run(const at::Tensor& q, const at::Tensor& k_slab, const at::Tensor& v_slab,
         const at::Tensor& tables, const at::Tensor& lens, int64_t block_size,
         at::Tensor& out) {
  const int64_t batch = q.size(0), n_heads = q.size(1), head_dim = q.size(2);
  const int64_t n_kv_heads = k_slab.size(1), group = n_heads / n_kv_heads;
  const int64_t width = tables.size(1), row_stride = n_kv_heads * head_dim;
  const float scale = 1.f / std::sqrt(static_cast<float>(head_dim));
  const T* q_data = q.data_ptr<T>();
  const T* k_data = k_slab.data_ptr<T>();
  const T* v_data = v_slab.data_ptr<T>();
  const int64_t* table_data = tables.data_ptr<int64_t>();
  const int64_t* len_data = lens.data_ptr<int64_t>();
  T* out_data = out.data_ptr<T>();
  const int64_t longest = *std::max_element(len_data, len_data + batch);
  // a task is ~longest * group * head_dim * 4 flops: small steps stay on one thread,
  // where waking the pool would cost more than the work
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, longest * group * head_dim));
  at::parallel_for(0, batch * n_kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_dim), scores(group * longest), totals(group),
        row_buffer(head_dim), result(group * head_dim);
    std::vector<int64_t> offsets(longest);
    int64_t offsets_of = -1;  // the sequence whose row offsets `offsets` holds
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / n_kv_heads, kv_head = task % n_kv_heads;
      const int64_t length = len_data[seq];
      if (offsets_of != seq) {  // each context position's slab row, walked block by block
        const int64_t* table = table_data + seq * width;
        for (int64_t t = 0, j = 0; t < length; ++j)
          for (int64_t i = 0; i < block_size && t < length; ++i, ++t)
            offsets[t] = (table[j] * block_size + i) * row_stride;
        offsets_of = seq;
      }
      const T* q_group = q_data + (seq * n_heads + kv_head * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i)
        query[i] = static_cast<float>(q_group[i]) * scale;
      attend_group<D, T>(query.data(), k_data + kv_head * head_dim,
                         v_data + kv_head * head_dim, offsets.data(), length, group,
                         head_dim, scores.data(), totals.data(), row_buffer.data(), result.data());
      T* o = out_data + (seq * n_heads + kv_head * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) o[i] = static_cast<T>(result[i]);
    }
  });
}

template <typename T>
void run_for_dim(const at::Tensor& q, const at::Tensor& k_slab, const at::Tensor& v_slab,
                 const at::Tensor& tables, const at::Tensor& lens, int64_t block_size,
                 at::Tensor& out) {
  switch (q.size(2)) {
    case 32: return run<32, T>(q, k_slab, v_slab, tables, lens, block_size, out);
    case 64: return run<64, T>(q, k_slab, v_slab, tables, lens, block_size, out);
    case 128: return run<128, T>(q, k_slab, v_slab, tables, lens, block_size, out);
    default: return run<0, T>(q, k_slab, v_slab, tables, lens, block_size, out);
  }
}

at::Tensor paged_decode_cpu(const at::Tensor& q_in, const at::Tensor& k_slab,
                            const at::Tensor& v_slab, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t block_size) {
  TORCH_CHECK(q_in.dim() == 3, "paged_decode_cpu: q must be (batch, heads, head_dim), got ",
              q_in.sizes());
  TORCH_CHECK(k_slab.dim() == 3 && k_slab.sizes() == v_slab.sizes(),
              "paged_decode_cpu: k_slab and v_slab must both be (rows, kv_heads, head_dim), got ",
              k_slab.sizes(), " and ", v_slab.sizes());
  TORCH_CHECK(k_slab.is_contiguous() && v_slab.is_contiguous(),
              "paged_decode_cpu: the slabs must be contiguous");
  TORCH_CHECK(q_in.scalar_type() == k_slab.scalar_type() &&
                  k_slab.scalar_type() == v_slab.scalar_type(),
              "paged_decode_cpu: q, k_slab and v_slab need one dtype");
  const int64_t batch = q_in.size(0), n_heads = q_in.size(1), head_dim = q_in.size(2);
  const int64_t n_kv_heads = k_slab.size(1);
  TORCH_CHECK(k_slab.size(2) == head_dim, "paged_decode_cpu: q's head_dim ", head_dim,
              " != the slabs' ", k_slab.size(2));
  TORCH_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "paged_decode_cpu: ", n_heads,
              " query heads are not a multiple of ", n_kv_heads, " KV heads");
  TORCH_CHECK(block_size > 0 && k_slab.size(0) % block_size == 0,
              "paged_decode_cpu: the slabs' ", k_slab.size(0),
              " rows are not whole blocks of ", block_size);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch &&
                  context_lens.dim() == 1 && context_lens.size(0) == batch,
              "paged_decode_cpu: block_tables must be (batch, width) and context_lens "
              "(batch,) for batch ", batch);
  at::Tensor q = q_in.contiguous();
  at::Tensor tables = block_tables.to(at::kLong).contiguous();
  at::Tensor lens = context_lens.to(at::kLong).contiguous();
  at::Tensor out = at::empty_like(q);
  if (batch == 0) return out;
  const int64_t num_blocks = k_slab.size(0) / block_size, width = tables.size(1);
  const int64_t* table_data = tables.data_ptr<int64_t>();
  const int64_t* len_data = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {  // reads outside the slabs would be silent
    TORCH_CHECK(len_data[b] > 0 && len_data[b] <= width * block_size,
                "paged_decode_cpu: context length ", len_data[b], " of row ", b,
                " is not within its table's ", width * block_size, " slots");
    for (int64_t j = 0; j < (len_data[b] + block_size - 1) / block_size; ++j) {
      const int64_t block = table_data[b * width + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_cpu: block ", block,
                  " of row ", b, " is outside the slabs' ", num_blocks, " blocks");
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(),
                                  "paged_decode_cpu", [&] {
    run_for_dim<scalar_t>(q, k_slab, v_slab, tables, lens, block_size, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(lathe, CPU, m) {
  m.impl("paged_decode_cpu", &paged_decode_cpu);
}
