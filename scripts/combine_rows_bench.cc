// The MoE host combine's row loop (SumSlots, ffi/cpu/moe_sum_rows.inc) alone, outside XLA
// and jaxcomm's runtime: bfloat16 rows against float32 rows on the same routing, calls of
// the two alternated, rows in memory (not cache). It separates what the kernel costs from
// what a call around it costs (docs/benchmarks.md, 2026-12-02 09:20).
//
// Routing as `python -m jaxcomm.bench moe` draws it: every token of every rank picks K
// distinct experts out of E, uniformly; each rank's expert rows are ordered by (local
// expert, source rank, token), as the dispatch writes them. The threads split the ranks'
// tokens in contiguous blocks (with 2 threads, 4 ranks each, as jaxcomm's parts do).
//
//   g++ -O3 -std=c++17 -ffp-contract=off -Iffi -pthread scripts/combine_rows_bench.cc -o /tmp/crb
//   T=128 H=7168 E=256 /tmp/crb      # decode size
//   T=4096 H=1024 E=64 /tmp/crb      # training size
//
// Environment: T tokens per rank, H columns, E experts (8 ranks, top-8), NT threads (2),
// N timed calls of each dtype (40), STREAM_FROM the result bytes a rank from which results
// are written in streaming stores (4 MiB, JAXCOMM_NONTEMPORAL_BYTES's default; 0: never).
// Prints whether each dtype's results stream, the medians and their ratio, then the rows'
// bytes per second: the kernel's, and those of the same loads in the same order without the
// arithmetic (the memory's speed for this access pattern, in the same run: the kernel's
// ceiling).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "cpu/moe_convert.h"
#include "cpu/result_stores.h"

namespace {

using jaxcomm::BF16T;
using jaxcomm::F32T;

constexpr int kRanks = 8, kTopK = 8;

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : fallback;
}

struct Routing {
  std::vector<int> expert;  // [R * T * K], ascending within a token
  std::vector<int> row;     // the slot's row on its expert's rank
  std::vector<int> rows;    // rows per rank
};

Routing Draw(int T, int E) {
  const int el = E / kRanks, slots = kRanks * T * kTopK;
  Routing r{std::vector<int>(slots), std::vector<int>(slots), std::vector<int>(kRanks, 0)};
  std::mt19937 gen(1);
  std::vector<int> all(E);
  for (int t = 0; t < kRanks * T; ++t) {
    std::iota(all.begin(), all.end(), 0);
    for (int j = 0; j < kTopK; ++j) std::swap(all[j], all[j + gen() % (E - j)]);
    std::sort(all.begin(), all.begin() + kTopK);
    std::copy(all.begin(), all.begin() + kTopK, r.expert.begin() + static_cast<size_t>(t) * kTopK);
  }
  // Slots in (source, token) order, so each expert's rows follow that order.
  std::vector<int> count(E, 0), first(E, 0), filled(E, 0);
  for (int e : r.expert) ++count[e];
  for (int e = 0; e < E; ++e) first[e] = e % el == 0 ? 0 : first[e - 1] + count[e - 1];
  for (int i = 0; i < slots; ++i) {
    const int e = r.expert[i];
    r.row[i] = first[e] + filled[e]++;
    r.rows[e / el] = std::max(r.rows[e / el], r.row[i] + 1);
  }
  return r;
}

// Timed passes over one dtype's rows, each returning milliseconds: `combine`, every rank's
// tokens summed; `read`, the same rows loaded in the same order and nothing computed.
struct Passes {
  std::function<double()> combine, read;
  double row_bytes = 0;  // what each pass reads
  bool streams = false;   // whether `combine` writes its results in streaming stores
};

// Runs fn(begin, end) on `threads` threads, thread w taking tokens [begin, end) of the
// ranks' kRanks * T in a contiguous block (as jaxcomm's parts do); returns the
// milliseconds until the last finished.
template <typename Fn>
double TimeThreads(int threads, int T, const Fn& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w) {
    pool.emplace_back([&fn, w, threads, T] { fn(kRanks * T * w / threads, kRanks * T * (w + 1) / threads); });
  }
  for (auto& th : pool) th.join();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

template <typename In>
Passes Combine(const Routing& routing, int T, int H, int E, int threads, int64_t stream_from) {
  using S = typename In::Storage;
  struct Token {
    const void* rows[kTopK];
    float weights[kTopK];
    bool opens[kTopK];
  };
  const int el = E / kRanks;
  auto peers = std::make_shared<std::vector<std::vector<S>>>(kRanks);
  for (int r = 0; r < kRanks; ++r) (*peers)[r].assign(static_cast<size_t>(routing.rows[r]) * H, In::Store(0.5f));
  auto tokens = std::make_shared<std::vector<Token>>(kRanks * T);
  for (int t = 0; t < kRanks * T; ++t) {
    for (int j = 0; j < kTopK; ++j) {
      const size_t i = static_cast<size_t>(t) * kTopK + j;
      const int d = routing.expert[i] / el;
      Token& tok = (*tokens)[t];
      tok.rows[j] = (*peers)[d].data() + static_cast<size_t>(routing.row[i]) * H;
      tok.weights[j] = 0.1f;
      tok.opens[j] = j == 0 || d != routing.expert[i - 1] / el;
    }
  }
  // One result per rank, reused by every call (in memory, as XLA's reused results are):
  // written in streaming stores from `stream_from` bytes a rank, as jaxcomm writes them
  // (JAXCOMM_NONTEMPORAL_BYTES).
  auto out = std::make_shared<std::vector<std::vector<S>>>(kRanks, std::vector<S>(static_cast<size_t>(T) * H));
  Passes passes;
  passes.streams = stream_from > 0 && static_cast<int64_t>(T) * H * static_cast<int64_t>(sizeof(S)) >= stream_from;
  passes.combine = [peers, tokens, out, T, H, threads, stream = passes.streams] {  // peers: the rows read
    return TimeThreads(threads, T, [&](int begin, int end) {
      for (int t = begin; t < end; ++t) {
        const Token& tok = (*tokens)[t];
        S* y = (*out)[t / T].data() + static_cast<size_t>(t % T) * H;
        jaxcomm::cpu::SumSlots<In, In>(y, nullptr, tok.rows, tok.weights, tok.opens, kTopK, H, false, stream);
      }
      if (stream) jaxcomm::cpu::FenceStreamingStores();
    });
  };
  // The same loads in the same order, XORed into eight accumulators in place of the
  // conversions and sums.
  for (const auto& rows : *peers) passes.row_bytes += static_cast<double>(rows.size() * sizeof(S));
  auto sink = std::make_shared<std::atomic<uint64_t>>(0);  // keeps the loads from being dropped
  passes.read = [peers, tokens, sink, T, H, threads] {
    const size_t words = static_cast<size_t>(H) * sizeof(S) / 8;
    return TimeThreads(threads, T, [&](int begin, int end) {
      uint64_t acc[8] = {};
      for (int t = begin; t < end; ++t) {
        const Token& tok = (*tokens)[t];
        for (size_t i = 0; i + 8 <= words; i += 8) {
          for (int j = 0; j < kTopK; ++j) {
            const char* x = static_cast<const char*>(tok.rows[j]) + 8 * i;
            for (int k = 0; k < 8; ++k) {
              uint64_t word;  // rows start wherever H puts them: copied, not dereferenced
              std::memcpy(&word, x + 8 * k, sizeof word);
              acc[k] ^= word;
            }
          }
        }
      }
      sink->fetch_xor(acc[0] ^ acc[1] ^ acc[2] ^ acc[3] ^ acc[4] ^ acc[5] ^ acc[6] ^ acc[7]);
    });
  };
  return passes;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main() {
  const int T = EnvInt("T", 128), H = EnvInt("H", 7168), E = EnvInt("E", 256);
  const int threads = EnvInt("NT", 2), n = EnvInt("N", 40);
  const Routing routing = Draw(T, E);
  const int64_t stream_from = EnvInt("STREAM_FROM", 4 << 20);
  const Passes bf16 = Combine<BF16T>(routing, T, H, E, threads, stream_from);
  const Passes f32 = Combine<F32T>(routing, T, H, E, threads, stream_from);
  bf16.combine();
  f32.combine();
  std::vector<double> tb, tf, rb, rf;
  for (int i = 0; i < n; ++i) {  // the four passes alternated: the same load falls on each
    tb.push_back(bf16.combine());
    rb.push_back(bf16.read());
    tf.push_back(f32.combine());
    rf.push_back(f32.read());
  }
  const auto gbs = [](double bytes, double ms) { return bytes / ms / 1e6; };
  const auto yes = [](bool b) { return b ? "yes" : "no"; };
  std::printf("T=%d H=%d E=%d, %d threads, streaming stores (STREAM_FROM=%ld): bfloat16 %s, float32 %s\n", T, H, E,
              threads, static_cast<long>(stream_from), yes(bf16.streams), yes(f32.streams));
  std::printf("bfloat16 %.2f ms, float32 %.2f ms, ratio %.3f\n", Median(tb), Median(tf), Median(tb) / Median(tf));
  std::printf("rows read, GB/s: bfloat16 %.1f (loads alone %.1f, %.0f%%), float32 %.1f (loads alone %.1f, %.0f%%)\n",
              gbs(bf16.row_bytes, Median(tb)), gbs(bf16.row_bytes, Median(rb)), 100 * Median(rb) / Median(tb),
              gbs(f32.row_bytes, Median(tf)), gbs(f32.row_bytes, Median(rf)), 100 * Median(rf) / Median(tf));
}
