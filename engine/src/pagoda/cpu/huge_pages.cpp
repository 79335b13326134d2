// Transparent huge pages for the tensors a decode step streams in full.
//
// Each step reads every weight (1.19 GB at the Qwen3-0.6B shape) and the requests' K/V blocks. With 4 KB pages
// that is a TLB miss and a page walk every 4 KB, and the hardware prefetchers stop at each 4 KB boundary. In one
// interleaved A/B on a 2-core Zen 4 VM, 2 MB pages made the layer linears 2-11% faster (batch 1: 34.1-37.3 ms
// -> 30.3-34.2 ms; 32 rows: 81.6-85.0 -> 78.3-79.8 ms). The memory is a private anonymous mapping aligned to
// 2 MB and madvised before first touch, so the kernel backs it with huge pages when THP is "madvise" or "always".
#include "huge_pages.h"

#include <torch/library.h>

#include <sys/mman.h>

#include <cstdint>

namespace pagoda_memory {

namespace {
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kMinBytes = size_t{4} << 20;  // below this the rounding to whole 2 MB pages wastes too much
}  // namespace

at::Tensor huge_page_empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype);
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) * c10::elementSize(dtype);
  if (bytes < kMinBytes) return at::empty(sizes, options);
  const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  const size_t length = rounded + kHugePage;  // room to align the start
  void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(base != MAP_FAILED, "could not map ", length, " bytes");
  const uintptr_t start = (reinterpret_cast<uintptr_t>(base) + kHugePage - 1) & ~(kHugePage - 1);
  void* data = reinterpret_cast<void*>(start);
#ifdef MADV_HUGEPAGE
  madvise(data, rounded, MADV_HUGEPAGE);  // advice only: fails harmlessly where THP is compiled out
#endif
  return at::from_blob(data, sizes, [base, length](void*) { munmap(base, length); }, options);
}

namespace {
// zeros on huge pages: the whole tensor is written now, so its memory is committed at allocation (a KV cache that
// faulted in lazily could exceed a container's limit mid-serving instead of at startup)
at::Tensor huge_page_zeros(at::IntArrayRef sizes, at::ScalarType dtype) { return huge_page_empty(sizes, dtype).zero_(); }
}  // namespace

}  // namespace pagoda_memory

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("huge_page_zeros(int[] size, ScalarType dtype) -> Tensor", &pagoda_memory::huge_page_zeros);
}
