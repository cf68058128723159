#include "cuda/process_exchange.h"

#include <algorithm>
#include <future>
#include <numeric>

#include "core/registry.h"

namespace jaxcomm::cuda {

std::shared_ptr<const ExchangePlan> MakePlan(uint64_t key, std::vector<int64_t> peers, size_t bytes,
                                             const std::vector<std::string>& peer_desc) {
  // The transport wants the peers in one order everywhere: ascending.
  std::vector<size_t> order(peers.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return peers[a] < peers[b]; });
  auto plan = std::make_shared<ExchangePlan>();
  plan->key = key;
  plan->fingerprint = key ^ (static_cast<uint64_t>(bytes) * 0x9e3779b97f4a7c15ull);
  for (size_t i : order) {
    plan->peers.push_back(peers[i]);
    plan->peer_bytes.push_back(bytes);
    plan->peer_desc.push_back(i < peer_desc.size() ? peer_desc[i] : "");
  }
  return plan;
}

std::string ExchangeRecords(const std::shared_ptr<const ExchangePlan>& plan, int64_t seq,
                            const std::string& mine, std::chrono::steady_clock::time_point deadline,
                            std::vector<std::string>* theirs, bool* timed_out) {
  *timed_out = false;
  CrossProcess* world = Registry::Get().cross_process();
  if (world == nullptr) {
    return "jaxcomm's cross-process transport is not set up in this process (it is linked when a "
           "program whose groups span processes is lowered)";
  }
  struct Outcome {
    std::string error;
    bool timed_out = false;
    std::vector<std::string> blobs;
  };
  auto promise = std::make_shared<std::promise<Outcome>>();
  std::future<Outcome> outcome = promise->get_future();
  ExchangeSpec spec;
  spec.plan = plan;
  spec.seq = seq;
  spec.mine = {{mine.data(), mine.size()}};
  spec.deadline = deadline;
  const auto sizes = plan->peer_bytes;
  world->Exchange(std::move(spec), [promise, sizes](const std::string& error, bool late,
                                                    const std::vector<const char*>& blobs) {
    Outcome o;
    o.error = error;
    o.timed_out = late;
    if (error.empty()) {
      for (size_t i = 0; i < blobs.size(); ++i) o.blobs.emplace_back(blobs[i], sizes[i]);
    }
    promise->set_value(std::move(o));
  });
  // The transport answers by the deadline; the margin only guards against a transport
  // that does not, and the callback keeps the promise alive if it answers later.
  if (outcome.wait_until(deadline + std::chrono::seconds(5)) != std::future_status::ready) {
    *timed_out = true;
    return "the cross-process transport did not answer by the deadline";
  }
  Outcome o = outcome.get();
  if (o.error.empty()) world->Release(*plan, seq);
  *timed_out = o.timed_out;
  *theirs = std::move(o.blobs);
  return o.error;
}

}  // namespace jaxcomm::cuda
