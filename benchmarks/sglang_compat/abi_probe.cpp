// abi_probe.cpp: prints the parts of torch's C++ ABI that sgl_kernel's inline header code depends on
// (data-member offsets of c10::TensorImpl / c10::StorageImpl, c10::DispatchKey numbers, at::Tag
// numbers), as seen by code compiled against one torch's headers. Build it against two torches and
// diff the output: abi_probe.sh does that. Nothing runs against torch's libraries.
//
// The private members are reached through the explicit-instantiation rule: access checking does
// not apply to template arguments of an explicit instantiation, so &TensorImpl::numel_ may be
// passed to one. It only reads offsets. No torch object is created.
#include <ATen/core/enum_tag.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <cstring>

template <typename Tag, typename Tag::type M>
struct Rob {
  friend typename Tag::type get(Tag) { return M; }
};
#define FIELD(Cls, name, T)                                                              \
  struct Tag_##Cls##_##name {                                                            \
    typedef T c10::Cls::*type;                                                           \
    friend type get(Tag_##Cls##_##name);                                                 \
  };                                                                                     \
  template struct Rob<Tag_##Cls##_##name, &c10::Cls::name>;                              \
  static size_t off_##Cls##_##name() {                                                   \
    auto p = get(Tag_##Cls##_##name());                                                  \
    size_t o;                                                                            \
    std::memcpy(&o, &p, sizeof o);                                                       \
    return o;                                                                            \
  }

FIELD(TensorImpl, storage_, c10::Storage)
FIELD(TensorImpl, autograd_meta_, std::unique_ptr<c10::AutogradMetaInterface>)
FIELD(TensorImpl, extra_meta_, std::unique_ptr<c10::ExtraMeta>)
FIELD(TensorImpl, version_counter_, c10::VariableVersion)
FIELD(TensorImpl, pyobj_slot_, c10::impl::PyObjectSlot)
FIELD(TensorImpl, sizes_and_strides_, c10::impl::SizesAndStrides)
FIELD(TensorImpl, storage_offset_, int64_t)
FIELD(TensorImpl, numel_, int64_t)
FIELD(TensorImpl, data_type_, caffe2::TypeMeta)
FIELD(TensorImpl, device_opt_, std::optional<c10::Device>)
FIELD(TensorImpl, key_set_, c10::DispatchKeySet)
FIELD(StorageImpl, data_ptr_, c10::DataPtr)
FIELD(StorageImpl, size_bytes_, c10::SymInt)
FIELD(StorageImpl, allocator_, c10::Allocator*)
FIELD(StorageImpl, pyobj_slot_, c10::impl::PyObjectSlot)
FIELD(StorageImpl, extra_meta_, std::unique_ptr<c10::StorageExtraMeta>)

#define OFF(Cls, name) std::printf("offsetof %s::%s %zu\n", #Cls, #name, off_##Cls##_##name());
#define KEY(k) std::printf("DispatchKey::%s %d\n", #k, static_cast<int>(c10::DispatchKey::k));
#define TAG(t) std::printf("at::Tag::%s %d\n", #t, static_cast<int>(at::Tag::t));

int main() {
  OFF(TensorImpl, storage_) OFF(TensorImpl, autograd_meta_) OFF(TensorImpl, extra_meta_)
  OFF(TensorImpl, version_counter_) OFF(TensorImpl, pyobj_slot_) OFF(TensorImpl, sizes_and_strides_)
  OFF(TensorImpl, storage_offset_) OFF(TensorImpl, numel_) OFF(TensorImpl, data_type_)
  OFF(TensorImpl, device_opt_) OFF(TensorImpl, key_set_)
  OFF(StorageImpl, data_ptr_) OFF(StorageImpl, size_bytes_) OFF(StorageImpl, allocator_)
  OFF(StorageImpl, pyobj_slot_) OFF(StorageImpl, extra_meta_)
  std::printf("sizeof TensorImpl %zu\nsizeof StorageImpl %zu\nsizeof PyObjectSlot %zu\nsizeof Error %zu\n",
              sizeof(c10::TensorImpl), sizeof(c10::StorageImpl), sizeof(c10::impl::PyObjectSlot),
              sizeof(c10::Error));
  KEY(BackendSelect) KEY(Python) KEY(Fake) KEY(Functionalize) KEY(Conjugate) KEY(ADInplaceOrView)
  KEY(AutogradOther) KEY(AutogradFunctionality) KEY(EndOfFunctionalityKeys) KEY(CPU) KEY(CUDA)
  KEY(Meta) KEY(AutogradCPU) KEY(AutogradCUDA) KEY(CompositeImplicitAutograd) KEY(CompositeExplicitAutograd)
  std::printf("DispatchKeySet autograd_dispatch_keyset_with_ADInplaceOrView repr 0x%llx\n",
              static_cast<unsigned long long>(c10::autograd_dispatch_keyset_with_ADInplaceOrView.raw_repr()));
  TAG(core) TAG(generated) TAG(inplace_view) TAG(needs_fixed_stride_order) TAG(pt2_compliant_tag) TAG(view_copy)
  return 0;
}
