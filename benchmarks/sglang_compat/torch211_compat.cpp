// torch211_compat.cpp: a symbol bridge that lets sglang-kernel 0.4.10 (built against torch 2.14.1)
// be dlopen()ed by torch 2.11.0.
//
// WARNING (see README.md here): this file only supplies the *link-time* symbols that torch 2.11
// lacks. It does NOT make sglang-kernel 0.4.10 ABI-compatible with torch 2.11. The two torches lay
// out c10::TensorImpl differently (torch 2.13 shrank c10::impl::PyObjectSlot from 16 to 8 bytes,
// so sizes_and_strides_, numel_, data_type_, device_opt_ and key_set_ sit 8 bytes lower), and they
// number c10::DispatchKey differently (DispatchKey::Named is gone, so 2.14's CUDA == 2.11's CPU).
// sgl_kernel's inline header code reads those fields and passes those keys, so its ops read
// the wrong fields and register under the wrong keys even when the import works. Use it to show
// how far the import gets, not to run sgl_kernel.
//
// Build: build.sh here (g++, -std=c++17, against torch 2.11's own headers, linked to libc10,
// libc10_cuda and libtorch_cpu). Use: LD_PRELOAD=.../libtorch211_compat.so, or
// ctypes.CDLL(path, RTLD_GLOBAL) before `import sgl_kernel`. None of the symbols overrides a torch
// 2.11 definition (2.11 has none of them), so it is enough to load them before common_ops. Only
// LD_PRELOAD has been tested.
//
// The five symbols: `nm -D --undefined-only sgl_kernel/sm90/common_ops.abi3.so`, minus everything
// torch 2.11.0's torch/lib/*.so define (sm100/common_ops imports the same set):
//   1 _ZN3c1019NotImplementedErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE
//   2 _ZN3c104cuda19CUDAErrorLogCaptureC1Ev
//   3 _ZN3c104cuda29c10_cuda_check_implementationEiPKcS2_jbPNS0_19CUDAErrorLogCaptureE
//   4 _ZNR5torch7Library4_defEON3c1014FunctionSchemaEPNS1_12OperatorNameERKSt6vectorINS_10headeronly3TagESaIS8_EENS_17_RegisterOrVerifyE
//   5 _ZNR5torch7Library4_defEOSt7variantIJN3c1012OperatorNameENS2_14FunctionSchemaEEEONS_11CppFunctionERKSt6vectorINS_10headeronly3TagESaISB_EE
//
// Each one is defined below as a plain function whose linkage name is set with an asm label. A
// C1 ("complete object") constructor or a non-static member function has the same x86-64
// calling convention as a free function that takes `this` first. In the Itanium ABI the caller
// owns and destroys by-value class arguments passed by invisible reference (std::string here), so
// the callee must not destroy them, and a free function with the same parameter list does not.
//
// Everything here is written for this project; only the signatures come from torch's headers.

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <new>
#include <string>
#include <utility>
#include <vector>

#define COMPAT_EXPORT extern "C" __attribute__((visibility("default"), used))

// ---------------------------------------------------------------------------------------------
// (1) c10::NotImplementedError::NotImplementedError(c10::SourceLocation, std::string)
//
// torch 2.14 (c10/util/Exception.h) declares this constructor out of line for every Error
// subclass. In torch 2.11 NotImplementedError only inherits Error's constructors
// (`using Error::Error;`), so code built against 2.11 gets it inline and libc10 exports no such
// symbol. sgl_kernel reaches it through TORCH_CHECK_NOT_IMPLEMENTED. The data members of
// c10::Error are the same in 2.11 and 2.14 (checked: sizeof(c10::Error) is the same in both), so
// the caller's exception buffer fits. We build the object in place with 2.11's inherited
// constructor: Error(SourceLocation, std::string), exported by 2.11's libc10, followed by
// NotImplementedError's 2.11 vtable. That is what a 2.11-built caller would have done inline.
COMPAT_EXPORT void compat_NotImplementedError_ctor(
    c10::NotImplementedError* self,
    c10::SourceLocation source_location,
    std::string msg) __asm__(
    "_ZN3c1019NotImplementedErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE");

void compat_NotImplementedError_ctor(
    c10::NotImplementedError* self,
    c10::SourceLocation source_location,
    std::string msg) {
  // The caller owns `msg` (invisible reference) and destroys it after we return; moving out
  // of it leaves it valid but unspecified, which is all its destructor needs.
  ::new (static_cast<void*>(self)) c10::NotImplementedError(source_location, std::move(msg));
}

// ---------------------------------------------------------------------------------------------
// (2) c10::cuda::CUDAErrorLogCapture::CUDAErrorLogCapture()
//
// New in torch 2.13/2.14 (c10/cuda/CUDAException.h): `class C10_CUDA_API CUDAErrorLogCapture {
// public: CUDAErrorLogCapture() noexcept; std::string get_error_log_suffix() noexcept; };`. The
// class has no data members (sizeof == 1), and 2.14's C10_CUDA_CHECK puts one on the stack
// before each CUDA runtime call, then passes its address to the 6-argument check (3). The class
// only exists to add a driver error-log suffix to the message of a failed check, and torch 2.11
// has no such log, so construction does nothing: there is no state to set up. It is noexcept in
// 2.14, and this does not throw either.
namespace compat_detail {
struct CUDAErrorLogCapture {};  // stand-in for the 2.14 class: empty, as there
}  // namespace compat_detail

COMPAT_EXPORT void compat_CUDAErrorLogCapture_ctor(compat_detail::CUDAErrorLogCapture* /*self*/) noexcept
    __asm__("_ZN3c104cuda19CUDAErrorLogCaptureC1Ev");

void compat_CUDAErrorLogCapture_ctor(compat_detail::CUDAErrorLogCapture* /*self*/) noexcept {}

// ---------------------------------------------------------------------------------------------
// (3) c10::cuda::c10_cuda_check_implementation(int, const char*, const char*, unsigned, bool,
//                                              c10::cuda::CUDAErrorLogCapture*)
//
// torch 2.14 added the trailing `CUDAErrorLogCapture* error_log = nullptr` parameter to the
// torch 2.11 function `C10_CUDA_API void c10_cuda_check_implementation(const int32_t err, const
// char* filename, const char* function_name, const uint32_t line_number, const bool
// include_device_assertions)`, which libc10_cuda exports. 2.14's C10_CUDA_CHECK calls it after
// every wrapped CUDA call, success included: it returns when err == cudaSuccess and throws
// otherwise. We forward the first five arguments to 2.11's function, which does the checking,
// the device-side assertion report and the throw. The capture pointer would only add a log
// suffix to the message, so it is ignored.
//
// 2.11's function is reached by its linkage name, _ZN3c104cuda29c10_cuda_check_implementationEiPKcS2_jb,
// instead of through <c10/cuda/CUDAException.h>, because that header needs the CUDA toolkit's
// <cuda.h>, which the build machine may not have. The parameter types are those of 2.11's
// declaration. The link (-z defs) fails if libc10_cuda doesn't export the name, and build.sh
// checks it with nm as well.
extern "C" void compat_real_c10_cuda_check_5(
    const int32_t err,
    const char* filename,
    const char* function_name,
    const uint32_t line_number,
    const bool include_device_assertions) __asm__("_ZN3c104cuda29c10_cuda_check_implementationEiPKcS2_jb");

COMPAT_EXPORT void compat_c10_cuda_check_6(
    const int32_t err,
    const char* filename,
    const char* function_name,
    const uint32_t line_number,
    const bool include_device_assertions,
    compat_detail::CUDAErrorLogCapture* /*error_log: no 2.11 equivalent, ignored*/)
    __asm__("_ZN3c104cuda29c10_cuda_check_implementationEiPKcS2_jbPNS0_19CUDAErrorLogCaptureE");

void compat_c10_cuda_check_6(
    const int32_t err,
    const char* filename,
    const char* function_name,
    const uint32_t line_number,
    const bool include_device_assertions,
    compat_detail::CUDAErrorLogCapture* /*error_log*/) {
  compat_real_c10_cuda_check_5(err, filename, function_name, line_number, include_device_assertions);
}

// ---------------------------------------------------------------------------------------------
// (4), (5) torch::Library::_def(..., const std::vector<torch::headeronly::Tag>&, ...) &
//
// torch 2.14 moved `enum class Tag` from namespace at (ATen/core/enum_tag.h) to
// torch::headeronly (torch/headeronly/core/enum_tag.h) and keeps `using torch::headeronly::Tag`
// in at. That changes the mangled names of both private _def overloads that TORCH_LIBRARY's
// m.def(...) calls. The enum's numbering changed too: 2.14 inserted `inplace` and `out`. A
// 2.14 tag value therefore has to be converted by name, not passed through. The two tags with
// no 2.11 meaning are dropped: tags are metadata read by torch.compile and friends, and 2.11
// cannot act on a tag it does not know.
namespace compat_detail {

// torch 2.14.1's torch/headeronly/core/enum_tag.h, in declaration order (values 0..19).
enum class Tag214 : int {
  core, cudagraph_unsafe, data_dependent_output, dynamic_output_shape, flexible_layout,
  generated, inplace, inplace_view, maybe_aliasing_or_mutating, needs_contiguous_strides,
  needs_exact_strides, needs_fixed_stride_order, nondeterministic_bitwise,
  nondeterministic_seeded, out, out_variant, pointwise, pt2_compliant_tag, reduction, view_copy,
  kCount
};

// Returns false for the 2.14-only tags (inplace, out) and for values beyond 2.14's enum.
bool to_tag211(int v, at::Tag* out) {
  using T = Tag214;
  switch (static_cast<T>(v)) {
    case T::core: *out = at::Tag::core; return true;
    case T::cudagraph_unsafe: *out = at::Tag::cudagraph_unsafe; return true;
    case T::data_dependent_output: *out = at::Tag::data_dependent_output; return true;
    case T::dynamic_output_shape: *out = at::Tag::dynamic_output_shape; return true;
    case T::flexible_layout: *out = at::Tag::flexible_layout; return true;
    case T::generated: *out = at::Tag::generated; return true;
    case T::inplace_view: *out = at::Tag::inplace_view; return true;
    case T::maybe_aliasing_or_mutating: *out = at::Tag::maybe_aliasing_or_mutating; return true;
    case T::needs_contiguous_strides: *out = at::Tag::needs_contiguous_strides; return true;
    case T::needs_exact_strides: *out = at::Tag::needs_exact_strides; return true;
    case T::needs_fixed_stride_order: *out = at::Tag::needs_fixed_stride_order; return true;
    case T::nondeterministic_bitwise: *out = at::Tag::nondeterministic_bitwise; return true;
    case T::nondeterministic_seeded: *out = at::Tag::nondeterministic_seeded; return true;
    case T::out_variant: *out = at::Tag::out_variant; return true;
    case T::pointwise: *out = at::Tag::pointwise; return true;
    case T::pt2_compliant_tag: *out = at::Tag::pt2_compliant_tag; return true;
    case T::reduction: *out = at::Tag::reduction; return true;
    case T::view_copy: *out = at::Tag::view_copy; return true;
    default: return false;  // inplace, out (2.14 only) or out of range
  }
}

// A std::vector of a 4-byte enum has the same layout whatever the enum's name, so the 2.14
// vector<headeronly::Tag> is read here as a vector<int>.
std::vector<at::Tag> to_tags211(const std::vector<int>& tags214) {
  std::vector<at::Tag> r;
  r.reserve(tags214.size());
  for (int v : tags214) {
    at::Tag t;
    if (to_tag211(v, &t)) r.push_back(t);
  }
  return r;
}

}  // namespace compat_detail

static_assert(sizeof(at::Tag) == sizeof(int), "at::Tag is an int-sized enum class");

// torch 2.11's own private overloads, called by their exported linkage names. They are private
// in torch/library.h, and the linkage names are the only way in that doesn't redefine the class.
extern "C" torch::Library& compat_real_def_schema_211(
    torch::Library* self,
    c10::FunctionSchema&& schema,
    c10::OperatorName* out_name,
    const std::vector<at::Tag>& tags,
    torch::_RegisterOrVerify rv)
    __asm__("_ZNR5torch7Library4_defEON3c1014FunctionSchemaEPNS1_12OperatorNameERKSt6vectorIN2at3TagESaIS8_EENS_17_RegisterOrVerifyE");

extern "C" torch::Library& compat_real_def_fn_211(
    torch::Library* self,
    std::variant<c10::OperatorName, c10::FunctionSchema>&& name_or_schema,
    torch::CppFunction&& f,
    const std::vector<at::Tag>& tags)
    __asm__("_ZNR5torch7Library4_defEOSt7variantIJN3c1012OperatorNameENS2_14FunctionSchemaEEEONS_11CppFunctionERKSt6vectorIN2at3TagESaISB_EE");

// (4) Library& Library::_def(c10::FunctionSchema&&, c10::OperatorName*,
//                            const std::vector<torch::headeronly::Tag>&, _RegisterOrVerify) &
COMPAT_EXPORT torch::Library& compat_def_schema_214(
    torch::Library* self,
    c10::FunctionSchema&& schema,
    c10::OperatorName* out_name,
    const std::vector<int>& tags214,
    torch::_RegisterOrVerify rv)
    __asm__("_ZNR5torch7Library4_defEON3c1014FunctionSchemaEPNS1_12OperatorNameERKSt6vectorINS_10headeronly3TagESaIS8_EENS_17_RegisterOrVerifyE");

torch::Library& compat_def_schema_214(
    torch::Library* self,
    c10::FunctionSchema&& schema,
    c10::OperatorName* out_name,
    const std::vector<int>& tags214,
    torch::_RegisterOrVerify rv) {
  return compat_real_def_schema_211(self, std::move(schema), out_name,
                                    compat_detail::to_tags211(tags214), rv);
}

// (5) Library& Library::_def(std::variant<c10::OperatorName, c10::FunctionSchema>&&,
//                            CppFunction&&, const std::vector<torch::headeronly::Tag>&) &
// The CppFunction is handed on untouched. If it was built with torch::dispatch(key, fn) it
// carries a 2.14-numbered DispatchKey, and 2.11 misreads that (see the warning at the top).
COMPAT_EXPORT torch::Library& compat_def_fn_214(
    torch::Library* self,
    std::variant<c10::OperatorName, c10::FunctionSchema>&& name_or_schema,
    torch::CppFunction&& f,
    const std::vector<int>& tags214)
    __asm__("_ZNR5torch7Library4_defEOSt7variantIJN3c1012OperatorNameENS2_14FunctionSchemaEEEONS_11CppFunctionERKSt6vectorINS_10headeronly3TagESaISB_EE");

torch::Library& compat_def_fn_214(
    torch::Library* self,
    std::variant<c10::OperatorName, c10::FunctionSchema>&& name_or_schema,
    torch::CppFunction&& f,
    const std::vector<int>& tags214) {
  return compat_real_def_fn_211(self, std::move(name_or_schema), std::move(f),
                                compat_detail::to_tags211(tags214));
}

// A marker so that `strings`/`nm` can tell which shim is loaded.
COMPAT_EXPORT const char torch211_compat_version[] = "torch211_compat 1 (sglang-kernel 0.4.10 -> torch 2.11.0)";
