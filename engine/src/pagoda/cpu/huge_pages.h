// Large, long-lived CPU tensors (packed weights, KV caches) on 2 MB pages.
#pragma once

#include <ATen/ATen.h>

namespace pagoda_memory {

// An uninitialised tensor whose memory is madvised for transparent huge pages before anything touches it, when it
// is large enough to be worth a 2 MB page (smaller ones: at::empty). Without THP ("never") these are ordinary pages.
at::Tensor huge_page_empty(at::IntArrayRef sizes, at::ScalarType dtype);

}  // namespace pagoda_memory
