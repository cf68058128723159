#include "cpu/transport/mpi_library.h"

#include <dlfcn.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>

namespace jaxcomm::cpu {
namespace {

template <typename Fn>
bool Find(void* handle, const char* name, Fn* fn, std::string* error) {
  *fn = reinterpret_cast<Fn>(dlsym(handle, name));
  if (*fn == nullptr && error->empty()) *error = std::string("it has no ") + name;
  return *fn != nullptr;
}

// MPI_Status is at most this many bytes in every implementation seen (Open MPI 24,
// MPICH 20, the standard ABI 32); the bootstrap's size is checked against it.
constexpr size_t kMaxStatusBytes = 256;
// MPI_MAX_ERROR_STRING: 256 in Open MPI, 1024 in MPICH.
constexpr int kMaxErrorString = 4096;

}  // namespace

std::unique_ptr<MpiLibrary> MpiLibrary::Load(const MpiAbi& abi, std::string* error) {
  if (abi.handle_bytes != 4 && abi.handle_bytes != 8) {
    *error = "sizeof(MPI_Request) is " + std::to_string(abi.handle_bytes) + " (4 or 8 expected)";
    return nullptr;
  }
  if (abi.status_bytes <= 0 || static_cast<size_t>(abi.status_bytes) > kMaxStatusBytes) {
    *error = "sizeof(MPI_Status) is " + std::to_string(abi.status_bytes);
    return nullptr;
  }
  std::unique_ptr<MpiLibrary> lib(new MpiLibrary());
  lib->abi_ = abi;
  // RTLD_NOLOAD: the very library mpi4py loaded (and initialized), never a second copy.
  lib->handle_ = dlopen(abi.library.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (lib->handle_ == nullptr) {
    const char* why = dlerror();
    *error = "the MPI library '" + abi.library + "' is not loaded in this process (mpi4py loads it): " +
             (why ? why : "");
    return nullptr;
  }
  std::string missing;
  Find(lib->handle_, "MPI_Isend", &lib->isend_, &missing);
  Find(lib->handle_, "MPI_Irecv", &lib->irecv_, &missing);
  Find(lib->handle_, "MPI_Test", &lib->test_, &missing);
  Find(lib->handle_, "MPI_Cancel", &lib->cancel_, &missing);
  Find(lib->handle_, "MPI_Request_free", &lib->request_free_, &missing);
  Find(lib->handle_, "MPI_Error_string", &lib->error_string_, &missing);
  Find(lib->handle_, "MPI_Error_class", &lib->error_class_, &missing);
  Find(lib->handle_, "MPI_Finalized", &lib->finalized_, &missing);
  if (!missing.empty()) {
    *error = "'" + abi.library + "' is not an MPI library: " + missing;
    return nullptr;
  }
  return lib;
}

MpiLibrary::~MpiLibrary() {
  if (handle_ != nullptr) dlclose(handle_);
}

int MpiLibrary::Isend(const void* data, size_t bytes, int peer, int tag, MpiRequest* request) {
  request->handle = 0;
  const int rc = isend_(data, static_cast<int>(bytes), static_cast<Handle>(abi_.byte), peer, tag,
                        static_cast<Handle>(abi_.comm), &request->handle);
  request->active = rc == 0;
  return rc;
}

int MpiLibrary::Irecv(void* data, size_t bytes, int peer, int tag, MpiRequest* request) {
  request->handle = 0;
  const int rc = irecv_(data, static_cast<int>(bytes), static_cast<Handle>(abi_.byte), peer, tag,
                        static_cast<Handle>(abi_.comm), &request->handle);
  request->active = rc == 0;
  return rc;
}

int MpiLibrary::Test(MpiRequest* request, bool* done) {
  alignas(16) char status[kMaxStatusBytes];
  int flag = 0;
  const int rc = test_(&request->handle, &flag, status);
  *done = rc != 0 || flag != 0;
  if (*done) request->active = false;
  return rc;
}

void MpiLibrary::Abandon(MpiRequest* request) {
  if (!request->active) return;
  cancel_(&request->handle);
  request_free_(&request->handle);
  request->active = false;
}

std::string MpiLibrary::ErrorText(int code) {
  std::vector<char> text(kMaxErrorString, '\0');
  int length = 0;
  if (error_string_(code, text.data(), &length) != 0) return "MPI error " + std::to_string(code);
  return std::string(text.data(), static_cast<size_t>(std::max(0, std::min(length, kMaxErrorString - 1))));
}

bool MpiLibrary::ProcessFailed(int code) {
  int error_class = -1;
  return abi_.proc_failed >= 0 && error_class_(code, &error_class) == 0 && error_class == abi_.proc_failed;
}

bool MpiLibrary::Finalized() {
  int flag = 0;
  return finalized_(&flag) != 0 || flag != 0;
}

}  // namespace jaxcomm::cpu
