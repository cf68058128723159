// The SIMT layer's block runner (see include/jaxcomm_simt.h): a block's threads are
// ucontext fibers on the stream's worker thread, scheduled round robin; each runs until it
// waits at a barrier or returns. A barrier completes when every live thread of its scope
// (block, or warp) arrived; a thread that returned counts as arrived, as on the GPU.
#include <sys/mman.h>
#include <ucontext.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "jaxcomm_simt.h"

namespace jaxcomm::simt {
namespace {

constexpr size_t kStackBytes = 64 * 1024;

enum class Wait : uint8_t { kNone, kBlock, kWarp };

struct Fiber {
  ucontext_t ctx;
  uint3 tid;
  int linear = 0;
  Wait wait = Wait::kNone;
  uint64_t wait_gen = 0;
  bool done = false;
};

// A barrier over a set of threads: `arrived` of `live`; generation `gen` completes when
// they are equal. Values exchanged at a barrier go to slot[gen & 1]: a thread that left
// barrier g cannot write slot (g & 1) again before everyone left barrier g + 1.
struct Barrier {
  int live = 0;
  int arrived = 0;
  uint64_t gen = 0;
  int count[2] = {0, 0};  // __syncthreads_count's sum per parity
  int result[2] = {0, 0};

  bool Arrive() {  // true: this arrival completed the barrier
    return ++arrived == live && Complete();
  }
  bool Complete() {
    const int p = gen & 1;
    result[p] = count[p];
    count[p ^ 1] = 0;
    arrived = 0;
    ++gen;
    return true;
  }
  // A thread left: the barrier may now be complete.
  void Leave() {
    --live;
    if (arrived > 0 && arrived == live) Complete();
  }
};

struct Warp {
  Barrier bar;
  uint64_t slot[2][32] = {};
};

class Runner {
 public:
  void Run(dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()>& body, const char* name);

  Fiber* current = nullptr;
  uint3 block_idx{};
  dim3 block_dim, grid_dim;
  std::vector<unsigned char> shared;
  Barrier block_bar;
  std::vector<Warp> warps;
  std::vector<Fiber> fibers_;

  void Yield(Wait w, uint64_t gen) {
    Fiber* f = current;
    f->wait = w;
    f->wait_gen = gen;
    swapcontext(&f->ctx, &sched_);
    f->wait = Wait::kNone;
  }

 private:
  static void Entry();
  bool Runnable(const Fiber& f) const {
    if (f.done) return false;
    switch (f.wait) {
      case Wait::kNone: return true;
      case Wait::kBlock: return block_bar.gen != f.wait_gen;
      case Wait::kWarp: return warps[f.linear / 32].bar.gen != f.wait_gen;
    }
    return false;
  }
  bool RunBlock();

  ucontext_t sched_;
  std::vector<std::unique_ptr<char, void (*)(char*)>> stacks_;
  const std::function<void()>* body_ = nullptr;
  std::string failure_;
};

thread_local Runner* runner = nullptr;

Runner& R() { return *runner; }

void Runner::Entry() {
  Runner& r = R();
  (*r.body_)();
  Fiber* f = r.current;
  f->done = true;
  r.block_bar.Leave();
  r.warps[f->linear / 32].bar.Leave();
  // uc_link returns to the scheduler.
}

bool Runner::RunBlock() {
  const int n = static_cast<int>(block_dim.x * block_dim.y * block_dim.z);
  block_bar = Barrier{};
  block_bar.live = n;
  warps.assign((n + 31) / 32, Warp{});
  for (int w = 0; w < static_cast<int>(warps.size()); ++w) warps[w].bar.live = std::min(32, n - w * 32);
  // Shared memory holds whatever the last block left: poison it.
  const uint32_t poison = ::jaxcomm::cuda_emu::kPoison;
  for (size_t i = 0; i + 4 <= shared.size(); i += 4) std::memcpy(&shared[i], &poison, 4);
  for (int i = 0; i < n; ++i) {
    Fiber& f = fibers_[i];
    f.linear = i;
    f.tid = uint3{static_cast<unsigned>(i % block_dim.x), static_cast<unsigned>((i / block_dim.x) % block_dim.y),
                  static_cast<unsigned>(i / (block_dim.x * block_dim.y))};
    f.wait = Wait::kNone;
    f.done = false;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks_[i].get();
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &sched_;
    makecontext(&f.ctx, &Runner::Entry, 0);
  }
  int finished = 0;
  while (finished < n) {
    bool progressed = false;
    for (int i = 0; i < n; ++i) {
      Fiber& f = fibers_[i];
      if (!Runnable(f)) continue;
      current = &f;
      swapcontext(&sched_, &f.ctx);
      progressed = true;
      if (f.done) ++finished;
    }
    if (!progressed) return false;  // threads wait at a barrier the others never reach
  }
  return true;
}

void Runner::Run(dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()>& body, const char* name) {
  const int n = static_cast<int>(block.x * block.y * block.z);
  while (static_cast<int>(stacks_.size()) < n) {
    void* p = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      ::jaxcomm::cuda_emu::RaiseStickyError(cudaErrorLaunchOutOfResources, "no memory for the SIMT fibers' stacks");
      return;
    }
    stacks_.emplace_back(static_cast<char*>(p), [](char* s) { munmap(s, kStackBytes); });
  }
  if (static_cast<int>(fibers_.size()) < n) fibers_.resize(n);
  shared.assign(shared_bytes, 0);
  block_dim = block;
  grid_dim = grid;
  body_ = &body;
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        block_idx = uint3{x, y, z};
        if (!RunBlock()) {
          ::jaxcomm::cuda_emu::RaiseStickyError(
              cudaErrorLaunchFailure, std::string(name) + ": block (" + std::to_string(x) + "," + std::to_string(y) +
                                          "," + std::to_string(z) +
                                          ") deadlocked: threads wait at a barrier that other threads never reach");
          return;
        }
      }
    }
  }
}

}  // namespace

const uint3& ThreadIdx() { return R().current->tid; }
const uint3& BlockIdx() { return R().block_idx; }
const dim3& BlockDim() { return R().block_dim; }
const dim3& GridDim() { return R().grid_dim; }
void* DynamicSharedBytes() { return R().shared.data(); }
int LaneId() { return R().current->linear & 31; }

void SyncThreads() { SyncThreadsCount(0); }

int SyncThreadsCount(int predicate) {
  Runner& r = R();
  Barrier& b = r.block_bar;
  const uint64_t gen = b.gen;
  const int p = gen & 1;
  b.count[p] += predicate != 0;
  if (!b.Arrive()) r.Yield(Wait::kBlock, gen);
  return b.result[p];
}

void SyncWarp() {
  Runner& r = R();
  Barrier& b = r.warps[r.current->linear / 32].bar;
  const uint64_t gen = b.gen;
  if (!b.Arrive()) r.Yield(Wait::kWarp, gen);
}

namespace {
// Every live lane publishes `mine`; returns the parity whose slots hold the values.
int Publish(uint64_t mine) {
  Runner& r = R();
  Warp& w = r.warps[r.current->linear / 32];
  const uint64_t gen = w.bar.gen;
  const int p = gen & 1;
  w.slot[p][r.current->linear & 31] = mine;
  if (!w.bar.Arrive()) r.Yield(Wait::kWarp, gen);
  return p;
}
Warp& MyWarp() { return R().warps[R().current->linear / 32]; }
int WarpLanes() {
  const int n = static_cast<int>(R().block_dim.x * R().block_dim.y * R().block_dim.z);
  const int base = R().current->linear / 32 * 32;
  return std::min(32, n - base);
}
// Whether lane l of the caller's warp still runs (returned lanes take no part).
bool LaneLive(int l) { return !R().fibers_[R().current->linear / 32 * 32 + l].done; }
}  // namespace

uint64_t WarpExchange(uint64_t mine, int src_lane) {
  const int p = Publish(mine);
  if (src_lane < 0 || src_lane >= WarpLanes()) return mine;
  return MyWarp().slot[p][src_lane];
}

unsigned WarpBallot(int predicate) {
  const int p = Publish(predicate != 0);
  unsigned out = 0;
  for (int l = 0; l < WarpLanes(); ++l) out |= static_cast<unsigned>(LaneLive(l) && MyWarp().slot[p][l] != 0) << l;
  return out;
}

unsigned WarpMatchAny(uint64_t value) {
  const int p = Publish(value);
  unsigned out = 0;
  for (int l = 0; l < WarpLanes(); ++l) out |= static_cast<unsigned>(LaneLive(l) && MyWarp().slot[p][l] == value) << l;
  return out;
}

void RunGrid(dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()>& body, const char* name) {
  static thread_local Runner worker_runner;
  Runner* outer = runner;
  runner = &worker_runner;
  worker_runner.Run(grid, block, shared_bytes, body, name);
  runner = outer;
}

}  // namespace jaxcomm::simt
