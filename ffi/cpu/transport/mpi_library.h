// The MPI library of the user's mpi4py, reached at run time: jaxcomm is built and
// installed without MPI, and links none.
//
// Open MPI, MPICH (and its derivatives) and the MPI 5 standard ABI differ in their
// binary interfaces: handles are pointers in Open MPI and the standard ABI, ints in
// MPICH; constants (MPI_BYTE, MPI_REQUEST_NULL, ...) and MPI_Status's size differ. No
// table per implementation is kept here: the bootstrap (jaxcomm/_src/mpi.py) asks the
// user's mpi4py, which was built for that library, for every value jaxcomm needs, as
// numbers (MpiAbi): the library's path (the one mpi4py loaded), the handle values of
// jaxcomm's own communicator and of MPI_BYTE, sizeof(MPI_Request) and
// sizeof(MPI_Status). The functions are looked up in that library with dlsym, and every
// handle is passed as a register-sized integer: on LP64 Linux (x86-64, AArch64) an int or
// a pointer argument takes one integer register or stack slot alike, and the callee reads
// the width it declared, so one call works for both kinds of handle. Handles that the
// library writes (requests) go to 8 zeroed bytes, of which it writes sizeof(MPI_Request).
//
// Only nonblocking point-to-point calls and MPI_Test are used, so no call blocks: every
// wait is a poll against the caller's deadline. The communicator's error handler is
// MPI_ERRORS_RETURN (set by the bootstrap), so a failure is a return code, never an abort.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace jaxcomm::cpu {

// What mpi4py says of its MPI library and of jaxcomm's communicator (all numbers).
struct MpiAbi {
  std::string library;        // the loaded library's path
  int64_t comm = 0;           // jaxcomm's communicator (a duplicate of the user's world)
  int64_t byte = 0;           // MPI_BYTE
  int64_t handle_bytes = 8;   // sizeof(MPI_Request)
  int64_t status_bytes = 0;   // sizeof(MPI_Status)
  int64_t proc_failed = -1;   // MPI_ERR_PROC_FAILED's error class (ULFM), -1 when none
};

// One request: the handle the library wrote, and whether it is still in flight.
struct MpiRequest {
  uint64_t handle = 0;
  bool active = false;
};

class MpiLibrary {
 public:
  // Opens `abi.library` (already loaded by mpi4py: this adds a reference) and looks up
  // the functions; nullptr and `error` when it is not an MPI library.
  static std::unique_ptr<MpiLibrary> Load(const MpiAbi& abi, std::string* error);
  ~MpiLibrary();
  MpiLibrary(const MpiLibrary&) = delete;
  MpiLibrary& operator=(const MpiLibrary&) = delete;

  // MPI_Isend / MPI_Irecv of `bytes` (at most INT_MAX) bytes on jaxcomm's communicator:
  // MPI_SUCCESS or the error code.
  int Isend(const void* data, size_t bytes, int peer, int tag, MpiRequest* request);
  int Irecv(void* data, size_t bytes, int peer, int tag, MpiRequest* request);
  // MPI_Test: sets *done when the request finished (it is then no longer active).
  int Test(MpiRequest* request, bool* done);
  // MPI_Cancel then MPI_Request_free of an active request (at shutdown).
  void Abandon(MpiRequest* request);
  // What MPI says of error `code`, and whether it reports a failed process (ULFM).
  std::string ErrorText(int code);
  bool ProcessFailed(int code);
  // Whether MPI_Finalize has run (no call may follow it).
  bool Finalized();

 private:
  MpiLibrary() = default;
  using Handle = intptr_t;  // a communicator or datatype, whichever its width
  using IsendFn = int (*)(const void*, int, Handle, int, int, Handle, void*);
  using IrecvFn = int (*)(void*, int, Handle, int, int, Handle, void*);
  using TestFn = int (*)(void*, int*, void*);
  using RequestFn = int (*)(void*);
  using ErrorStringFn = int (*)(int, char*, int*);
  using ErrorClassFn = int (*)(int, int*);
  using FlagFn = int (*)(int*);

  MpiAbi abi_;
  void* handle_ = nullptr;  // dlopen's
  IsendFn isend_ = nullptr;
  IrecvFn irecv_ = nullptr;
  TestFn test_ = nullptr;
  RequestFn cancel_ = nullptr;
  RequestFn request_free_ = nullptr;
  ErrorStringFn error_string_ = nullptr;
  ErrorClassFn error_class_ = nullptr;
  FlagFn finalized_ = nullptr;
};

}  // namespace jaxcomm::cpu
