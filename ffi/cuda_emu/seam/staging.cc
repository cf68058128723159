#include "cuda_emu/seam/staging.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "cuda_emu/runtime/emu.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cuda_emu::seam {
namespace {

namespace ffi = xla::ffi;

constexpr size_t kAlign = 256;                  // XLA:GPU's buffer alignment
constexpr size_t kFirstRegion = size_t{4} << 20;

size_t RoundUp(size_t n) { return std::max<size_t>(kAlign, (n + kAlign - 1) / kAlign * kAlign); }

// One device's XLA arena: regions of emulated cudaMalloc, sub-allocated first-fit (the
// newest region first), free neighbours coalesced.
class Arena {
 public:
  void* Allocate(int device, size_t bytes, std::string* error) {
    const size_t need = RoundUp(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    for (auto r = regions_.rbegin(); r != regions_.rend(); ++r) {
      if (void* p = Take(*r, need)) return p;
    }
    size_t size = regions_.empty() ? kFirstRegion : regions_.back().size * 2;
    while (size < 2 * need) size *= 2;
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    void* base = nullptr;
    const cudaError_t e = cudaMalloc(&base, size);
    cudaSetDevice(previous);
    if (e != cudaSuccess) {
      *error = "the emulated XLA arena of device " + std::to_string(device) + " could not grow to " +
               std::to_string(size) + " bytes: " + cudaGetErrorString(e);
      return nullptr;
    }
    regions_.push_back(Region{static_cast<char*>(base), size, {{0, size}}});
    return Take(regions_.back(), need);
  }

  void Free(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = used_.find(p);
    if (it == used_.end()) return;
    const size_t size = it->second;
    used_.erase(it);
    for (Region& r : regions_) {
      if (p < r.base || p >= r.base + r.size) continue;
      size_t off = static_cast<char*>(p) - r.base, len = size;
      auto next = r.free.lower_bound(off);
      if (next != r.free.end() && next->first == off + len) {
        len += next->second;
        next = r.free.erase(next);
      }
      if (next != r.free.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second == off) {
          prev->second += len;
          return;
        }
      }
      r.free.emplace(off, len);
      return;
    }
  }

  void Count(uint64_t* bytes, uint64_t* regions) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Region& r : regions_) *bytes += r.size;
    *regions += regions_.size();
  }

 private:
  struct Region {
    char* base;
    size_t size;
    std::map<size_t, size_t> free;  // offset -> length
  };

  void* Take(Region& r, size_t need) {
    for (auto it = r.free.begin(); it != r.free.end(); ++it) {
      if (it->second < need) continue;
      const size_t off = it->first, left = it->second - need;
      r.free.erase(it);
      if (left > 0) r.free.emplace(off + need, left);
      void* p = r.base + off;
      used_[p] = need;
      return p;
    }
    return nullptr;
  }

  std::mutex mu_;
  std::vector<Region> regions_;
  std::map<void*, size_t> used_;
};

// A block of one call, or pinned for receive halves.
struct Block {
  void* staged = nullptr;
  size_t bytes = 0;
};

class Staging {
 public:
  static Staging& Get() {
    static Staging* s = new Staging();  // never destroyed: regions stay exported
    return *s;
  }

  Arena& arena(int device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& a = arenas_[device];
    if (!a) a = std::make_unique<Arena>();
    return *a;
  }

  // The block send halves pinned for (device, xla, bytes), if any, and which sends.
  bool FindPinned(int device, const void* xla, size_t bytes, Block* out, std::vector<uint64_t>* sends) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pinned_.find({device, xla});
    if (it == pinned_.end() || it->second.block.bytes != bytes) return false;
    *out = it->second.block;
    if (sends != nullptr) sends->assign(it->second.sends.begin(), it->second.sends.end());
    return true;
  }

  uint64_t NextSend() {
    std::lock_guard<std::mutex> lock(mu_);
    return ++sends_;
  }

  // Pins `b` under XLA:CPU's address for send half `send` (an operand two sends in flight
  // share: one block, both sends). A different block pinned there before belonged to a
  // send whose receive never ran (its program dropped it): freed.
  void Pin(int device, const void* xla, const Block& b, uint64_t send) {
    Block old;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Pinned& p = pinned_[{device, xla}];
      if (p.block.staged == b.staged) {
        p.sends.insert(send);
        return;
      }
      old = p.block;
      p.block = b;
      p.sends = {send};
    }
    if (old.staged != nullptr) arena(device).Free(old.staged);
  }

  // Frees the blocks of `device` that no send half but `sends` pinned.
  void Unpin(int device, const std::vector<uint64_t>& sends) {
    std::vector<void*> blocks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = pinned_.begin(); it != pinned_.end();) {
        if (it->first.first == device) {
          for (uint64_t s : sends) it->second.sends.erase(s);
        }
        if (it->first.first == device && it->second.sends.empty()) {
          blocks.push_back(it->second.block.staged);
          it = pinned_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (void* p : blocks) arena(device).Free(p);
  }

  void Record(uint64_t buffers, uint64_t in, uint64_t out, std::vector<StagedBuffer> last) {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.calls;
    stats_.buffers += buffers;
    stats_.bytes_in += in;
    stats_.bytes_out += out;
    stats_.last_call = std::move(last);
  }

  StagingStats Stats() {
    StagingStats s;
    std::vector<Arena*> arenas;
    {
      std::lock_guard<std::mutex> lock(mu_);
      s = stats_;
      s.pinned = pinned_.size();
      for (auto& [d, a] : arenas_) arenas.push_back(a.get());
    }
    for (Arena* a : arenas) a->Count(&s.arena_bytes, &s.arenas);
    return s;
  }

 private:
  std::mutex mu_;
  std::map<int, std::unique_ptr<Arena>> arenas_;
  struct Pinned {
    Block block;
    std::set<uint64_t> sends;
  };
  std::map<std::pair<int, const void*>, Pinned> pinned_;
  uint64_t sends_ = 0;
  StagingStats stats_;
};

// A buffer's size in XLA:CPU's memory; false for what is not staged (tokens, sub-byte
// types whose packing XLA:CPU decides).
bool StagedBytes(const XLA_FFI_Buffer& b, size_t* bytes) {
  const auto dtype = static_cast<ffi::DataType>(b.dtype);
  switch (dtype) {
    case ffi::DataType::INVALID:
    case ffi::DataType::TOKEN:
    case ffi::DataType::S1:
    case ffi::DataType::S2:
    case ffi::DataType::S4:
    case ffi::DataType::U1:
    case ffi::DataType::U2:
    case ffi::DataType::U4:
    case ffi::DataType::F4E2M1FN:
      return false;
    default:
      break;
  }
  size_t n = ffi::ByteWidth(dtype);
  for (int64_t i = 0; i < b.rank; ++i) n *= static_cast<size_t>(b.dims[i]);
  *bytes = n;
  return b.data != nullptr || n == 0;
}

int32_t Ordinal(const XLA_FFI_CallFrame* frame) {
  ffi::DiagnosticEngine diagnostic;
  auto device = ffi::CtxDecoding<ffi::DeviceOrdinal>::Decode(frame->api, frame->ctx, diagnostic);
  return device ? *device : 0;
}

XLA_FFI_Error* Error(const XLA_FFI_CallFrame* frame, const std::string& message) {
  return ffi::internal::CreateError(frame->api, ffi::Error::Internal(message));
}

void Poison(void* p, size_t bytes) {
  auto* words = static_cast<uint32_t*>(p);
  for (size_t i = 0; i < bytes / 4; ++i) words[i] = kPoison;
  std::memset(static_cast<char*>(p) + bytes / 4 * 4, 0xBA, bytes % 4);
}

}  // namespace

StagingStats Stats() { return Staging::Get().Stats(); }

XLA_FFI_Error* RunStaged(XLA_FFI_CallFrame* frame, CallKind kind,
                         const std::function<XLA_FFI_Error*(XLA_FFI_CallFrame*)>& handler) {
  Staging& staging = Staging::Get();
  const int device = Ordinal(frame);
  Arena& arena = staging.arena(device);
  const int64_t nargs = frame->args.size, nrets = frame->rets.size;

  // XLA:CPU's address -> this call's block (aliased operand and result: one block).
  struct Use {
    Block block;
    bool fresh = false;  // allocated for this call (else pinned by a send half)
    bool filled = false; // holds its operand's data
  };
  std::map<const void*, Use> blocks;
  std::vector<uint64_t> sends;  // a receive half's send halves
  std::string error;
  auto stage = [&](const XLA_FFI_Buffer& b, size_t bytes, bool operand) -> void* {
    auto it = blocks.find(b.data);
    if (it == blocks.end()) {
      Use u;
      std::vector<uint64_t> by;
      // A receive half finds its send's blocks: the live data (the send's results, the
      // operands it published). A send half shares an operand with a send still in flight.
      const bool look = kind == CallKind::kReceiveHalf || (kind == CallKind::kSendHalf && operand);
      if (look && staging.FindPinned(device, b.data, bytes, &u.block, &by)) {
        u.filled = true;
        if (kind == CallKind::kReceiveHalf) {
          for (uint64_t s : by) {
            if (std::find(sends.begin(), sends.end(), s) == sends.end()) sends.push_back(s);
          }
        }
      } else {
        u.block.staged = arena.Allocate(device, bytes, &error);
        if (u.block.staged == nullptr) return nullptr;
        u.block.bytes = bytes;
        u.fresh = true;
      }
      it = blocks.emplace(b.data, u).first;
    }
    Use& u = it->second;
    if (u.block.bytes < bytes) {  // one address, two sizes: never from XLA's buffer assignment
      error = "two buffers of one call start at one address with different sizes";
      return nullptr;
    }
    if (operand && !u.filled) {
      if (bytes > 0) std::memcpy(u.block.staged, b.data, bytes);
      u.filled = true;
    }
    return u.block.staged;
  };

  std::vector<XLA_FFI_Buffer> args(nargs), rets(nrets);
  std::vector<void*> arg_ptrs(frame->args.args, frame->args.args + nargs);
  std::vector<void*> ret_ptrs(frame->rets.rets, frame->rets.rets + nrets);
  std::vector<size_t> arg_bytes(nargs, 0), ret_bytes(nrets, 0);
  std::vector<bool> arg_staged(nargs, false), ret_staged(nrets, false);
  std::vector<StagedBuffer> seen;
  uint64_t in = 0, out = 0, count = 0;
  for (int64_t i = 0; i < nargs && error.empty(); ++i) {
    if (frame->args.types[i] != XLA_FFI_ArgType_BUFFER) continue;
    const auto* b = static_cast<const XLA_FFI_Buffer*>(frame->args.args[i]);
    if (!StagedBytes(*b, &arg_bytes[i])) continue;
    args[i] = *b;
    const bool had = blocks.count(b->data) && blocks[b->data].filled;
    args[i].data = stage(*b, arg_bytes[i], /*operand=*/true);
    if (args[i].data == nullptr) break;
    if (!had && blocks[b->data].fresh) in += arg_bytes[i];
    arg_ptrs[i] = &args[i];
    arg_staged[i] = true;
    ++count;
  }
  // Results: an operand's block where aliased; else fresh, poisoned (unless pinned: the
  // receive half's own results are its send's, completed in place).
  for (int64_t i = 0; i < nrets && error.empty(); ++i) {
    if (frame->rets.types[i] != XLA_FFI_RetType_BUFFER) continue;
    const auto* b = static_cast<const XLA_FFI_Buffer*>(frame->rets.rets[i]);
    if (!StagedBytes(*b, &ret_bytes[i])) continue;
    rets[i] = *b;
    const bool known = blocks.count(b->data) > 0;
    rets[i].data = stage(*b, ret_bytes[i], /*operand=*/false);
    if (rets[i].data == nullptr) break;
    if (!known && blocks[b->data].fresh) Poison(rets[i].data, ret_bytes[i]);
    ret_ptrs[i] = &rets[i];
    ret_staged[i] = true;
    ++count;
  }
  auto release = [&] {
    for (auto& [xla, u] : blocks) {
      if (u.fresh) arena.Free(u.block.staged);
    }
  };
  if (!error.empty()) {
    release();
    return Error(frame, "jaxcomm (emulated XLA seam): staging a call's buffers: " + error);
  }

  XLA_FFI_CallFrame staged = *frame;
  staged.args.args = arg_ptrs.data();
  staged.rets.rets = ret_ptrs.data();
  XLA_FFI_Error* result = handler(&staged);

  // The handler's XlaContext drained XLA's stream; again here, as the copies read it.
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  cudaStreamSynchronize(XlaStream(device));
  cudaSetDevice(previous);
  for (int64_t i = 0; i < nrets; ++i) {
    if (!ret_staged[i] || ret_bytes[i] == 0) continue;
    // A send's data is still being written on jaxcomm's stream: its receive copies it back.
    if (kind == CallKind::kSendHalf && i == 0) continue;
    auto* b = static_cast<XLA_FFI_Buffer*>(frame->rets.rets[i]);
    std::memcpy(b->data, rets[i].data, ret_bytes[i]);
    out += ret_bytes[i];
  }
  for (int64_t i = 0; i < nargs; ++i) {
    if (!arg_staged[i]) continue;
    const auto* b = static_cast<const XLA_FFI_Buffer*>(frame->args.args[i]);
    seen.push_back({reinterpret_cast<uintptr_t>(b->data), reinterpret_cast<uintptr_t>(args[i].data),
                    arg_bytes[i], IsDeviceAllocation(args[i].data, std::max<size_t>(arg_bytes[i], 1)), false});
  }
  for (int64_t i = 0; i < nrets; ++i) {
    if (!ret_staged[i]) continue;
    const auto* b = static_cast<const XLA_FFI_Buffer*>(frame->rets.rets[i]);
    seen.push_back({reinterpret_cast<uintptr_t>(b->data), reinterpret_cast<uintptr_t>(rets[i].data),
                    ret_bytes[i], IsDeviceAllocation(rets[i].data, std::max<size_t>(ret_bytes[i], 1)), true});
  }

  if (kind == CallKind::kSendHalf && result == nullptr) {
    // Everything the send published (and its results) stays for its receive half.
    const uint64_t send = staging.NextSend();
    for (auto& [xla, u] : blocks) staging.Pin(device, xla, u.block, send);
  } else {
    release();
  }
  // A failed receive may leave its send's movement running on jaxcomm's stream: its
  // blocks stay (leaked) rather than be handed to another call while still written.
  if (kind == CallKind::kReceiveHalf && result == nullptr && !sends.empty()) staging.Unpin(device, sends);
  staging.Record(count, in, out, std::move(seen));
  return result;
}

}  // namespace jaxcomm::cuda_emu::seam
