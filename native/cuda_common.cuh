// What the CUDA row copy and the layout transform share: CUDA's error text, the device scope
// every entry point runs in, and the vector types of their copies.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace kvxfer::cuda::common {

inline std::string fail(const char* what, cudaError_t err) {
  // Clear the sticky "last error" of a non-fatal failure so a later call is not blamed.
  (void)cudaGetLastError();
  return std::string(what) + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
}

// Runs with `device` current (unless negative) and restores the caller's device afterwards,
// so that embedding frameworks (torch) keep their notion of the current device.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (device < 0) return;
    err_ = cudaGetDevice(&previous_);
    if (err_ == cudaSuccess && previous_ != device) {
      err_ = cudaSetDevice(device);
      switched_ = err_ == cudaSuccess;
    }
  }
  ~DeviceScope() {
    if (switched_) (void)cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  cudaError_t error() const { return err_; }

 private:
  int previous_ = 0;
  bool switched_ = false;
  cudaError_t err_ = cudaSuccess;
};

template <int W> struct Vec;
template <> struct Vec<16> { using T = uint4; };
template <> struct Vec<8> { using T = uint2; };
template <> struct Vec<4> { using T = unsigned int; };
template <> struct Vec<1> { using T = unsigned char; };

}  // namespace kvxfer::cuda::common
