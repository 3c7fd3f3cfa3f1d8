// shim_test.cpp: compiled against torch 2.14.1's headers and linked against torch 2.11.0's libs plus
// libtorch211_compat.so, the way sgl_kernel uses them; checks what shim symbols (1)-(3) do. See README.md.
#include <c10/util/Exception.h>
#include <c10/cuda/CUDAException.h>
#include <cstdio>
static int fails = 0;
#define EXPECT(c) do { if (!(c)) { std::printf("FAIL %s:%d %s\n", __FILE__, __LINE__, #c); ++fails; } } while (0)
int main() {
  setvbuf(stdout, nullptr, _IONBF, 0);
  try {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "op ", 42, " is not implemented");
    EXPECT(false);
  } catch (const c10::NotImplementedError& e) {
    std::printf("caught NotImplementedError: %s\n", e.what_without_backtrace());
    EXPECT(std::string(e.what_without_backtrace()).find("op 42 is not implemented") != std::string::npos);
  }
  try { TORCH_CHECK_NOT_IMPLEMENTED(false, "as Error"); } catch (const c10::Error& e) { std::printf("caught as c10::Error: ok\n"); }
  // What C10_CUDA_CHECK expands to in 2.14, but with include_device_assertions=false: with true,
  // torch 2.11's own check first queries the device-assertion registry, which needs a driver.
  c10::cuda::CUDAErrorLogCapture cap;   // -> shim (2)
  c10::cuda::c10_cuda_check_implementation(cudaSuccess, __FILE__, __func__, __LINE__, false, &cap);  // -> shim (3)
  std::printf("check(cudaSuccess) returned\n");
  try {
    c10::cuda::c10_cuda_check_implementation(cudaErrorInvalidValue, __FILE__, __func__, __LINE__, false, &cap);
    EXPECT(false);
  } catch (const c10::AcceleratorError& e) {
    std::printf("caught AcceleratorError code=%d: %.80s\n", e.get_error_code(), e.what_without_backtrace());
    EXPECT(e.get_error_code() == cudaErrorInvalidValue);
  }
  std::printf(fails ? "shim test FAILED\n" : "shim test PASSED\n");
  return fails != 0;
}
