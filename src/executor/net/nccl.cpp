// NcclLibrary (dlopen + version check) and NcclComm. No CUDA or NCCL header: NCCL's C ABI is
// declared in tide/nccl.hpp with void* handles, as stable across NCCL 2.x.
#include "tide/nccl.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "tide/error.hpp"

namespace tide {

const NcclLibrary& NcclLibrary::get() {
  static std::once_flag once;
  static NcclLibrary* library = nullptr;
  static std::string failure;
  std::call_once(once, [] {
    std::vector<std::pair<std::string, int>> tries;  // (name, extra dlopen flags)
    if (const char* env = std::getenv("TIDE_NCCL_LIB"); env && *env) {
      tries.push_back({env, 0});
    } else {
      tries.push_back({"libnccl.so.2", RTLD_NOLOAD});  // already in the process (PyTorch's)
      tries.push_back({"libnccl.so.2", 0});
      tries.push_back({"libnccl.so", 0});
    }
    void* handle = nullptr;
    std::string where, looked;
    for (const auto& [name, flags] : tries) {
      handle = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL | flags);
      if (handle) {
        where = name + ((flags & RTLD_NOLOAD) ? " (already loaded in this process)" : "");
        break;
      }
      const char* why = ::dlerror();
      looked += detail::concat("\n  ", name, (flags & RTLD_NOLOAD) ? " in this process" : "", ": ",
                               why ? why : "not found");
    }
    if (!handle) {
      failure = "NCCL not found; looked for:" + looked +
                "\n(set TIDE_NCCL_LIB to the path of libnccl.so.2, or import torch first)";
      return;
    }
    auto* lib = new NcclLibrary();
    lib->handle_ = handle;
    lib->path_ = where;
    std::string missing;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(handle, name));
      if (!fn) missing += detail::concat(missing.empty() ? "" : ", ", name);
    };
    int (*get_version)(int*) = nullptr;
    sym(get_version, "ncclGetVersion");
    if (!get_version) {
      failure = detail::concat(where, " has no ncclGetVersion: not an NCCL library");
      return;
    }
    if (get_version(&lib->version_) != 0) lib->version_ = 0;
    if (lib->version_ < kMinVersion) {
      failure = detail::concat("NCCL at ", where, " is version ", lib->version_string(),
                               "; TIDE needs >= 2.18.0 (set TIDE_NCCL_LIB to a newer libnccl.so.2)");
      return;
    }
    sym(lib->get_unique_id, "ncclGetUniqueId");
    sym(lib->comm_init_rank, "ncclCommInitRank");
    sym(lib->comm_destroy, "ncclCommDestroy");
    sym(lib->comm_abort, "ncclCommAbort");
    sym(lib->comm_get_async_error, "ncclCommGetAsyncError");
    sym(lib->comm_count, "ncclCommCount");
    sym(lib->comm_user_rank, "ncclCommUserRank");
    sym(lib->comm_cu_device, "ncclCommCuDevice");
    sym(lib->get_error_string, "ncclGetErrorString");
    sym(lib->group_start, "ncclGroupStart");
    sym(lib->group_end, "ncclGroupEnd");
    sym(lib->send, "ncclSend");
    sym(lib->recv, "ncclRecv");
    sym(lib->all_gather, "ncclAllGather");
    sym(lib->reduce_scatter, "ncclReduceScatter");
    if (!missing.empty()) {
      failure = detail::concat("NCCL ", lib->version_string(), " at ", where,
                               " lacks entry points: ", missing);
      return;
    }
    library = lib;  // kept for the process's lifetime, like the library itself
  });
  if (!library) throw SystemError(failure);
  return *library;
}

std::string NcclLibrary::version_string() const {
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  return detail::concat(version_ / 10000, ".", version_ / 100 % 100, ".", version_ % 100);
}

void NcclLibrary::check(int result, const char* what) const {
  if (result == 0) return;
  throw SystemError(detail::concat(what, " failed: NCCL error ", result, " (",
                                   get_error_string ? get_error_string(result) : "?", ")"));
}

std::unique_ptr<NcclComm> NcclComm::create(Bootstrap& bootstrap) {
  const NcclLibrary& nccl = NcclLibrary::get();
  NcclLibrary::UniqueId id{};
  std::string mine;
  if (bootstrap.rank() == 0) {
    nccl.check(nccl.get_unique_id(&id), "ncclGetUniqueId");
    mine.assign(id.internal, sizeof id.internal);
  }
  const std::vector<std::string> all = bootstrap.allgather(mine);
  if (all[0].size() != sizeof id.internal)
    throw SystemError(detail::concat("NcclComm::create: rank 0 sent a ", all[0].size(),
                                     "-byte unique id, expected ", sizeof id.internal));
  std::memcpy(id.internal, all[0].data(), sizeof id.internal);
  void* comm = nullptr;
  nccl.check(nccl.comm_init_rank(&comm, bootstrap.world(), id, bootstrap.rank()),
             "ncclCommInitRank");
  auto out = wrap(comm);
  out->owned_ = true;
  return out;
}

std::unique_ptr<NcclComm> NcclComm::wrap(void* comm) {
  TIDE_CHECK_ARG(comm != nullptr, "NcclComm::wrap", "comm", "null", "an ncclComm_t");
  const NcclLibrary& nccl = NcclLibrary::get();
  std::unique_ptr<NcclComm> out(new NcclComm());
  out->comm_ = comm;
  nccl.check(nccl.comm_count(comm, &out->world_), "ncclCommCount");
  nccl.check(nccl.comm_user_rank(comm, &out->rank_), "ncclCommUserRank");
  nccl.check(nccl.comm_cu_device(comm, &out->device_), "ncclCommCuDevice");
  return out;
}

NcclComm::~NcclComm() {
  if (owned_ && !aborted_ && comm_) (void)NcclLibrary::get().comm_destroy(comm_);
}

void NcclComm::abort() {
  if (aborted_.exchange(true)) return;
  (void)NcclLibrary::get().comm_abort(comm_);
}

void NcclComm::check_async() const {
  if (aborted_) throw SystemError(detail::concat("NCCL communicator of rank ", rank_, " was aborted"));
  int result = 0;
  const NcclLibrary& nccl = NcclLibrary::get();
  nccl.check(nccl.comm_get_async_error(comm_, &result), "ncclCommGetAsyncError");
  nccl.check(result, detail::concat("NCCL communicator of rank ", rank_).c_str());
}

}  // namespace tide
