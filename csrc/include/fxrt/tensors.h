// Reading and writing safetensors files (the package's weights format), for tools around the
// runtime: the example runner reads its inputs from one and writes its outputs to another.

#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace fxrt {

// Every tensor of a safetensors file, in the order of its data (copies on the CPU). Throws
// PackageError for a malformed file.
std::vector<std::pair<std::string, at::Tensor>> load_tensors(const std::string& path);

// Writes tensors (copied to the CPU, contiguous) as a safetensors file.
void save_tensors(
    const std::string& path,
    const std::vector<std::pair<std::string, at::Tensor>>& tensors);

}  // namespace fxrt
