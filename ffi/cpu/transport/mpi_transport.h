// The MPI transport (transport.h): between processes of different hosts in a job started
// by an MPI launcher (mpirun, srun with PMI/PMIx), over the user's MPI library, loaded at
// run time (mpi_library.h). Within a host, shared memory stays (World prefers it).
//
// jaxcomm works on a communicator of its own, a duplicate of the user's world made by the
// bootstrap (jaxcomm/_src/mpi.py), never on the user's, with MPI_ERRORS_RETURN. Each peer
// gets a frame of its own per round (PeerTransport::Send), as over TCP:
//   * a header message (tag kFrameTag): key, seq, fingerprint, length, and either the
//     bytes themselves (rounds of at most kInlineBytes) or the sizes of the parts that
//     follow;
//   * larger rounds: the parts, in messages of at most 1 GiB, on a tag of their own per
//     frame (so frames need not be received in the order sent). The receiver posts
//     them when it reaches the round's call (Find): the frame of a call it has not
//     reached stays with the sender's MPI until then, costing this process no memory.
// Every call is nonblocking (MPI_Isend, MPI_Irecv, MPI_Test) and polled against the
// caller's deadline; a send may still read the caller's buffers after Send returned
// (Capabilities::sends_complete_later), so World waits for Delivered before it lets a
// round go.
//
// Threads. All of jaxcomm's MPI calls are made under one lock (mpi_mu_). With
// MPI_THREAD_MULTIPLE any thread waiting for a frame advances the requests itself; with
// less (MPI_THREAD_SERIALIZED), only this transport's own thread ("jaxcomm-mpi") calls
// MPI, and the others hand it their sends and wait for what it receives. The thread
// polls while a round is awaited (it spins for the spin budget, then naps), and wakes
// World when frames arrive.
//
// Health: a request that fails names the peer (MPI's error text; "it failed" when MPI
// reports a failed process, MPI_ERR_PROC_FAILED with ULFM); a peer on this machine is
// also watched by its pid. Without ULFM, MPI does not report a peer's death on other
// hosts: the call then ends at its deadline, naming the peers that did not arrive
// (docs/multiprocess.md).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cpu/transport/factory.h"
#include "cpu/transport/mpi_library.h"
#include "cpu/transport/transport.h"

namespace jaxcomm::cpu {

class MpiPeerTransport;

// This process's side: the library, jaxcomm's communicator, the thread that polls it.
class MpiTransport final : public Transport {
 public:
  // The factory's entry (factory.h). Settings (jaxcomm/_src/mpi.py): the MpiAbi fields
  // (library, comm, byte, handle_bytes, status_bytes, proc_failed), rank and size in the
  // communicator, tag_ub (MPI_TAG_UB), thread_multiple (1: MPI_THREAD_MULTIPLE), world (one
  // text for every process of the MPI job), machine (this machine's identity).
  static std::unique_ptr<Transport> Make(const TransportContext& context, const Params& settings, std::string* error);
  ~MpiTransport() override;

  const Capabilities& caps() const override;
  // {rank, size, world, machine}.
  Params Endpoint() const override;
  std::shared_ptr<PeerTransport> Link(const LinkRequest& request, std::string* error) override;
  void Close() override;

  std::string Publish(const Outgoing& /*round*/, const Parts& /*mine*/) override { return ""; }
  void Release(uint64_t /*key*/, int64_t /*seq*/) override {}
  void ShowWaits(const std::vector<WaitNotice>& /*notices*/) override {}
  std::string SkipRounds(uint64_t /*key*/, uint64_t /*fingerprint*/, size_t /*bytes*/, int64_t /*last*/) override {
    return "";  // nothing of a round stays behind
  }
  // A restarted process cannot join a running MPI job (without ULFM's recovery): none.
  std::vector<Rejoiner> Joins(const std::vector<int64_t>& /*candidates*/,
                              const std::function<bool(int64_t, uint64_t)>& /*wanted*/) override {
    return {};
  }

  // For the links. Advances the MPI requests now, on this thread, where the library
  // allows any thread and no other thread is at it; else hands it to the MPI thread.
  void Progress();
  // Someone waits for a frame or a send: the MPI thread polls for a while.
  void Busy();
  int tag_ub() const { return tag_ub_; }
  // Why the transport no longer works ("" while it does): closed at exit.
  bool closed() const { return closed_.load(std::memory_order_acquire); }

 private:
  MpiTransport() = default;
  // Advances every link's requests (mpi_mu_ held): true when something finished.
  bool Pump();
  void Run();  // the MPI thread

  TransportContext context_;
  std::unique_ptr<MpiLibrary> library_;
  int rank_ = -1, size_ = 0, tag_ub_ = 32767;
  bool any_thread_ = false;  // MPI_THREAD_MULTIPLE
  std::string world_, machine_;
  std::mutex mpi_mu_;    // held for every MPI call
  std::mutex links_mu_;  // links_
  std::vector<std::shared_ptr<MpiPeerTransport>> links_;
  std::atomic<bool> closed_{false};
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> busy_until_ns_{0};
  std::atomic<int> outstanding_{0};  // data receives and sends in flight (Pump's count)
  std::mutex cv_mu_;
  std::condition_variable cv_;
  bool kicked_ = false;  // under cv_mu_
  std::thread thread_;
};

// The link to one peer through jaxcomm's communicator.
class MpiPeerTransport final : public PeerTransport {
 public:
  MpiPeerTransport(MpiTransport& local, MpiLibrary& library, int rank, int local_pid, std::function<void()> wake);

  Transport& local() const override { return local_; }
  bool MayPublish(uint64_t /*key*/, int64_t /*seq*/) override { return true; }  // a frame is its own
  std::string Send(const Outgoing& round, const Parts& parts) override;
  bool Delivered(uint64_t key, int64_t seq) override;
  bool Find(uint64_t key, int64_t seq, uint64_t fingerprint, uint64_t bytes, Arrival* arrival,
            std::string* error) override;
  void Release(uint64_t key, int64_t seq) override;
  std::pair<int64_t, std::vector<char>> Newest(uint64_t key) override;
  std::string Failure() override;
  bool Failed() const override { return failed_.load(std::memory_order_relaxed); }
  std::vector<WaitNotice> Notices() override;
  std::string ShowWaits(const std::vector<WaitNotice>& notices, std::chrono::steady_clock::time_point deadline) override;
  // MPI processes cannot be readmitted (MpiTransport::Joins).
  void RequestJoin(int64_t /*process*/, uint64_t /*generation*/, std::chrono::steady_clock::time_point) override {}

  // The transport's side (its MPI lock held). Advances this link's requests: true when
  // something finished; `in_flight` counts the data receives and sends still going.
  bool Progress(int* in_flight);
  // Drops every request at shutdown, and fails the link with `why`.
  void Abandon(const std::string& why);

  // Rounds of at most this many bytes travel inside their header message.
  static constexpr size_t kInlineBytes = 16 << 10;
  // A header lists at most this many parts (a round of more goes out as one copy).
  static constexpr size_t kMaxParts = 64;

 private:
  struct OutFrame;
  struct InFrame;
  struct Expected {
    uint64_t fingerprint = 0;
    uint64_t bytes = 0;
    int64_t done = 0;  // the newest round of the call released
  };
  // Queues a frame (mu_ held by nobody; takes it).
  std::string Queue(std::unique_ptr<OutFrame> frame);
  // A header that arrived (mu_ held): "" or why the link fails.
  std::string Accept(const char* message);
  // Posts the data receives of `frame` (mu_ held): "" or the MPI error.
  std::string PostData(InFrame& frame, bool keep);
  void Fail(const std::string& why);  // mu_ held
  std::vector<char> TakeBuffer(size_t bytes);  // mu_ held
  void GiveBuffer(std::vector<char> buffer);   // mu_ held

  MpiTransport& local_;
  MpiLibrary& library_;
  const int rank_;       // the peer's rank in jaxcomm's communicator
  const int local_pid_;  // its pid when it runs on this machine, else 0
  const std::function<void()> wake_;
  mutable std::mutex mu_;
  std::deque<std::unique_ptr<OutFrame>> outgoing_;
  std::unordered_map<uint64_t, int64_t> sent_;  // by key: the newest round sent whole
  uint64_t frames_sent_ = 0;                    // numbers the frames' data tags
  int64_t notices_sent_ = 0;
  std::map<std::pair<uint64_t, int64_t>, std::unique_ptr<InFrame>> inbox_;
  std::map<uint64_t, Expected> expected_;
  std::vector<char> header_;  // the posted header receive's buffer
  MpiRequest header_request_;
  std::vector<WaitNotice> notices_;
  int64_t notices_seq_ = 0;
  std::vector<std::vector<char>> spare_;
  size_t spare_bytes_ = 0;
  std::string failure_;
  std::atomic<bool> failed_{false};
};

}  // namespace jaxcomm::cpu
