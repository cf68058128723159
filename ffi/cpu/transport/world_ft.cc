// World's fault-tolerant exchanges (ExchangeSpec::tolerant): the second phase in which the
// survivors agree on whose contributions count, and readmitting a restarted process
// (jaxcomm.ft.rejoin) at a round all of them agree on.
#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>

#include "cpu/transport/world.h"
#include "cpu/transport/world_internal.h"

namespace jaxcomm::cpu {
namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

void World::Agree(std::shared_ptr<const ExchangePlan> plan, int64_t seq,
                  std::chrono::steady_clock::time_point deadline, std::vector<const char*> blobs,
                  ExchangeDone then) {
  // Every process states whom it heard from, over the group's processes in one order
  // (sorted, this one included); a process counts when every survivor heard from it.
  std::vector<int64_t> all = plan->peers;
  all.push_back(process_);
  std::sort(all.begin(), all.end());
  // The message: one byte per process (heard from it), then per process the generation of
  // the rejoin request this process has seen from it (0: none).
  const size_t P = all.size();
  auto message = std::make_shared<std::vector<char>>(P * (1 + sizeof(uint64_t)), 0);
  PollJoins();
  for (size_t k = 0; k < P; ++k) {
    uint64_t seen = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = seen_join_.find(all[k]); it != seen_join_.end()) seen = it->second;
    }
    std::memcpy(message->data() + P + k * sizeof(uint64_t), &seen, sizeof(seen));
    if (all[k] == process_) {
      (*message)[k] = 1;
      continue;
    }
    const size_t i = std::find(plan->peers.begin(), plan->peers.end(), all[k]) - plan->peers.begin();
    (*message)[k] = blobs[i] != nullptr;
    if (!blobs[i]) Exclude(all[k]);
  }
  // A restarted process learns from these messages when it is readmitted: it is left out
  // of the exchange below, so it is sent its own (over shared memory it reads the
  // exchange's copy itself, and the send only wakes it).
  for (size_t k = 0; k < P; ++k) {
    std::shared_ptr<PeerTransport> joiner;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!excluded_.count(all[k]) || seen_join_[all[k]] <= admitted_join_[all[k]]) continue;
      if (auto it = peers_.find(all[k]); it != peers_.end()) joiner = it->second;
    }
    if (joiner) {
      joiner->Send({plan->agreement->key, plan->agreement->fingerprint, seq, deadline},
                   {{message->data(), message->size()}});
    }
  }
  ExchangeSpec spec;
  spec.plan = plan->agreement;
  spec.seq = seq;
  spec.tolerant = true;
  spec.mine = {{message->data(), message->size()}};
  // The survivors are all here already, or gone: a second full timeout is not needed,
  // but a slow one gets the same margin as the first phase had.
  spec.deadline = std::max(deadline, Clock::now()) + std::chrono::seconds(1);
  Exchange(std::move(spec), [this, plan, blobs, message, all, then](
                                const std::string& error, bool timed_out,
                                const std::vector<const char*>& views) mutable {
    if (!error.empty()) return then(error, timed_out, {});
    const size_t me = std::find(all.begin(), all.end(), process_) - all.begin();
    for (const char* v : views) {
      if (v != nullptr && v[me] == 0) {
        // The others did not hear from this process in time and went on without it.
        return then("the other processes left this process out of this call (it arrived after "
                    "their deadline); it stays out until it rejoins (jaxcomm.ft.rejoin)",
                    false, {});
      }
    }
    for (size_t i = 0; i < plan->peers.size(); ++i) {
      const size_t k = std::find(all.begin(), all.end(), plan->peers[i]) - all.begin();
      bool counted = blobs[i] != nullptr && views[i] != nullptr;
      for (size_t j = 0; j < views.size() && counted; ++j) {
        if (views[j] != nullptr && views[j][k] == 0) counted = false;
      }
      if (!counted) {
        blobs[i] = nullptr;
        Exclude(plan->peers[i]);
      }
    }
    // After the exclusions above: a process readmitted now takes part from the next round.
    Admit(all, *message, views);
    then("", false, blobs);
  });
}

void World::Admit(const std::vector<int64_t>& all, const std::vector<char>& mine,
                  const std::vector<const char*>& views) {
  // A process left out comes back from the next round when every survivor that answered
  // has seen its request: they all decide alike, from the same messages.
  const size_t P = all.size();
  auto seen_in = [P](const char* message, size_t k) {
    uint64_t g;
    std::memcpy(&g, message + P + k * sizeof(uint64_t), sizeof(g));
    return g;
  };
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t k = 0; k < P; ++k) {
    if (!excluded_.count(all[k])) continue;
    uint64_t g = seen_in(mine.data(), k);
    for (const char* v : views) {
      if (v != nullptr) g = std::min(g, seen_in(v, k));
    }
    if (g != 0 && g > admitted_join_[all[k]]) {
      admitted_join_[all[k]] = g;
      excluded_.erase(all[k]);
    }
  }
}

void World::PollJoins() {
  std::vector<int64_t> candidates;
  {
    std::lock_guard<std::mutex> lock(mu_);
    candidates.assign(excluded_.begin(), excluded_.end());
  }
  if (candidates.empty()) return;
  const auto wanted = [this](int64_t q, uint64_t generation) {
    std::lock_guard<std::mutex> lock(mu_);
    return generation > seen_join_[q];
  };
  for (Transport* transport : transports_) {
    for (Rejoiner& join : transport->Joins(candidates, wanted)) {
      const int64_t q = join.link->peer.process;
      std::lock_guard<std::mutex> lock(mu_);
      if (auto old = peers_.find(q); old != peers_.end()) join.link->peer.host = old->second->peer.host;
      peers_[q] = std::move(join.link);
      seen_join_[q] = join.generation;
    }
  }
}

std::string World::Rejoin(uint64_t generation) {
  std::lock_guard<std::mutex> lock(mu_);
  if (process_ < 0) return "rejoining needs this process's endpoint open";
  joining_ = generation;
  return "";
}

bool World::TryAdmission(Pending& p, std::string* error) {
  const ExchangePlan& plan = *p.spec.plan;
  const ExchangePlan& agreement = *plan.agreement;
  std::vector<int64_t> all = plan.peers;
  all.push_back(process_);
  std::sort(all.begin(), all.end());
  const size_t P = all.size();
  const size_t me = std::find(all.begin(), all.end(), process_) - all.begin();
  if (!p.join_posted) {
    // Posted on the first fault-tolerant call, when this process is ready to take part.
    for (auto& link : p.links) link->RequestJoin(process_, joining_, p.spec.deadline);
    p.join_posted = true;
  }
  // The survivors' newest agreement messages: they say who took part and what they saw.
  std::vector<std::pair<int64_t, std::vector<char>>> snaps;
  for (auto& link : p.links) snaps.push_back(link->Newest(agreement.key));
  int64_t newest = 0;
  const std::vector<char>* reference = nullptr;
  for (const auto& [seq, bytes] : snaps) {
    if (seq > newest && bytes.size() == P * (1 + sizeof(uint64_t))) {
      newest = seq;
      reference = &bytes;
    }
  }
  if (reference == nullptr) return false;
  for (size_t i = 0; i < p.links.size(); ++i) {
    const size_t k = std::find(all.begin(), all.end(), plan.peers[i]) - all.begin();
    if ((*reference)[k] == 0) continue;  // not a participant of that round
    const auto& [seq, bytes] = snaps[i];
    if (seq != newest) return false;  // not all there yet: look again
    uint64_t seen;
    std::memcpy(&seen, bytes.data() + P + me * sizeof(uint64_t), sizeof(seen));
    if (seen < joining_) return false;  // readmitted at a later round
  }
  // Readmitted from round newest + 1 of this call: adopt its numbering, take the
  // survivors' view of who is out, and mark this process's slots as read up to there,
  // so that the survivors never wait on rounds it did not take part in.
  const int64_t join = newest + 1;
  size_t bytes = 0;
  for (const auto& [ptr, n] : p.spec.mine) bytes += n;
  for (const auto& [key, fp, n] : {std::make_tuple(plan.key, plan.fingerprint, bytes),
                                   std::make_tuple(agreement.key, agreement.fingerprint,
                                                   P * (1 + sizeof(uint64_t)))}) {
    for (Transport* transport : transports_) {
      *error = transport->SkipRounds(key, fp, n, join - 1);
      if (!error->empty()) return true;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    seq_offset_[plan.key] = join - p.spec.seq;
    for (size_t k = 0; k < P; ++k) {
      if (k != me && (*reference)[k] == 0) {
        excluded_.insert(all[k]);
        ever_excluded_.store(true);
      }
    }
  }
  for (size_t i = 0; i < p.links.size(); ++i) {
    if (Excluded(plan.peers[i]) && !p.left_out[i]) {
      p.left_out[i] = true;
      ++p.settled;
    }
  }
  p.spec.seq = join;
  p.awaiting_admission = false;
  return true;
}

bool World::Excluded(int64_t process) const {
  std::lock_guard<std::mutex> lock(mu_);
  return excluded_.count(process) > 0;
}

void World::Exclude(int64_t process) {
  std::lock_guard<std::mutex> lock(mu_);
  excluded_.insert(process);
  ever_excluded_.store(true);
}

std::vector<int64_t> World::excluded() const {
  std::lock_guard<std::mutex> lock(mu_);
  return std::vector<int64_t>(excluded_.begin(), excluded_.end());
}

}  // namespace jaxcomm::cpu
