// A reduction over processes on several hosts, in three phases instead of every
// process sending its operands to every other:
//   1. local:  the processes of each host exchange their operands (shared memory), and
//              the host's leader (its lowest process index) reduces them;
//   2. across: the leaders exchange their hosts' results (TCP) and each reduces those,
//              in host order, so that every leader gets the same bits;
//   3. spread: each leader hands the result to the other processes of its host.
// What crosses between hosts drops from (processes per host)^2 copies of an operand per
// pair of hosts to one. Each phase is an exchange (core/cross_process.h) with its own
// plan, deadline and errors; a phase's continuation never runs on the transport's
// progress thread.
#include <algorithm>
#include <cstring>
#include <map>
#include <thread>

#include "core/registry.h"
#include "core/round.h"

namespace jaxcomm {
namespace {

// The hosts of `processes`, each as its processes ascending, ordered by their lowest;
// empty when some process's host is unknown.
std::vector<std::vector<int64_t>> Hosts(const CrossProcess& world, const std::vector<int64_t>& processes) {
  std::map<std::string, std::vector<int64_t>> by_key;
  for (int64_t p : processes) {
    std::string key = world.HostOf(p);
    if (key.empty()) return {};
    by_key[key].push_back(p);
  }
  std::vector<std::vector<int64_t>> hosts;
  for (auto& [key, members] : by_key) {
    std::sort(members.begin(), members.end());
    hosts.push_back(std::move(members));
  }
  std::sort(hosts.begin(), hosts.end());
  return hosts;
}

bool Worthwhile(const std::vector<std::vector<int64_t>>& hosts) {
  return hosts.size() >= 2 &&
         std::any_of(hosts.begin(), hosts.end(), [](const auto& h) { return h.size() >= 2; });
}

// One process's part in one hierarchical round; owned by the exchanges' callbacks.
class HierarchicalRound : public std::enable_shared_from_this<HierarchicalRound> {
 public:
  HierarchicalRound(std::shared_ptr<Round> round, int me, std::shared_ptr<const Hierarchy> h,
                    std::vector<int> local, const Peer& shape)
      : round_(std::move(round)), me_(me), h_(std::move(h)), local_(std::move(local)), shape_(shape),
        world_(Registry::Get().cross_process()), seq_(round_->execution),
        deadline_(Clock::now() + round_->timeout) {}

  void Start() {
    Registry::Get().recorder().Start(round_->peers);
    if (!h_->local) return Reduced({});
    std::vector<std::pair<const void*, size_t>> mine;
    for (int r : local_) mine.emplace_back(round_->peers[r].in, shape_.in_bytes);
    Phase(h_->local, std::move(mine), &HierarchicalRound::Reduced);
  }

 private:
  using Next = void (HierarchicalRound::*)(const std::vector<const char*>&);

  // Runs exchange `plan`, then `next` with the peers' contributions: on this thread if
  // the peers were there, else on a pool thread (never on the progress thread).
  void Phase(const std::shared_ptr<const ExchangePlan>& plan, std::vector<std::pair<const void*, size_t>> mine,
             Next next) {
    ExchangeSpec spec;
    spec.plan = plan;
    spec.seq = seq_;
    spec.mine = std::move(mine);
    spec.deadline = deadline_;
    const auto caller = std::this_thread::get_id();
    auto self = shared_from_this();
    world_->Exchange(std::move(spec), [self, caller, next](const std::string& error, bool timed_out,
                                                           const std::vector<const char*>& blobs) {
      const bool here = std::this_thread::get_id() == caller;
      if (!error.empty()) {
        RecordError(*self->round_, error);
        CompleteAll(*self->round_, here ? self->me_ : -1,
                    timed_out ? ffi::ErrorCode::kDeadlineExceeded : ffi::ErrorCode::kUnavailable);
        return;
      }
      if (here) {
        ((*self).*next)(blobs);
      } else {
        Registry::Get().pool().Post([self, next, blobs] { ((*self).*next)(blobs); });
      }
    });
  }

  std::string Combine(const std::vector<const void*>& in, void* out) const {
    return (*round_->combine)(in, out, static_cast<size_t>(shape_.elements));
  }

  // After phase 1: the leader reduces its host's operands.
  void Reduced(const std::vector<const char*>& blobs) {
    if (h_->leader) {
      std::vector<const void*> in;
      for (int r : local_) in.push_back(round_->peers[r].in);
      for (size_t i = 0; i < blobs.size(); ++i) {
        for (size_t k = 0; k < h_->local_ranks[i]; ++k) in.push_back(blobs[i] + k * shape_.in_bytes);
      }
      partial_ = h_->TakeBuffer(shape_.in_bytes);
      RecordError(*round_, Combine(in, partial_.data()));
    }
    if (h_->local) world_->Release(*h_->local, seq_);
    if (h_->leader) {
      Phase(h_->across, {{partial_.data(), partial_.size()}}, &HierarchicalRound::Combined);
    } else {
      Phase(h_->spread, {}, &HierarchicalRound::Spread);
    }
  }

  // After phase 2 (leaders): the result, from the hosts' results in host order.
  void Combined(const std::vector<const char*>& blobs) {
    std::vector<const void*> in(blobs.begin(), blobs.end());
    in.insert(in.begin() + static_cast<std::ptrdiff_t>(h_->host_index), partial_.data());
    void* first = round_->peers[local_.front()].out;
    RecordError(*round_, Combine(in, first));
    for (size_t i = 1; i < local_.size(); ++i) std::memcpy(round_->peers[local_[i]].out, first, shape_.in_bytes);
    world_->Release(*h_->across, seq_);
    h_->GiveBuffer(std::move(partial_));
    if (h_->spread) {
      Phase(h_->spread, {{first, shape_.in_bytes}}, &HierarchicalRound::Spread);
    } else {
      CompleteAll(*round_, me_, ffi::ErrorCode::kInternal);
    }
  }

  // After phase 3: the other processes of a host copy the leader's result.
  void Spread(const std::vector<const char*>& blobs) {
    if (!h_->leader) {
      for (int r : local_) std::memcpy(round_->peers[r].out, blobs[h_->leader_index], shape_.in_bytes);
    }
    world_->Release(*h_->spread, seq_);
    CompleteAll(*round_, me_, ffi::ErrorCode::kInternal);
  }

  std::shared_ptr<Round> round_;
  int me_;
  std::shared_ptr<const Hierarchy> h_;
  std::vector<int> local_;  // this process's ranks
  Peer shape_;
  CrossProcess* world_;
  int64_t seq_;
  Clock::time_point deadline_;
  std::vector<char> partial_;  // the leader's host result
};

}  // namespace

std::vector<char> Hierarchy::TakeBuffer(size_t bytes) const {
  std::vector<char> b;
  {
    std::lock_guard<std::mutex> lock(mu_);
    b.swap(spare_);
  }
  b.resize(bytes);
  return b;
}

void Hierarchy::GiveBuffer(std::vector<char> buffer) const {
  std::lock_guard<std::mutex> lock(mu_);
  spare_ = std::move(buffer);
}

bool SpansHostsHierarchically(const CrossProcess& world, const std::vector<int64_t>& processes) {
  return Worthwhile(Hosts(world, processes));
}

std::shared_ptr<const Hierarchy> PlanHierarchy(const CrossProcess& world, const ExchangePlan& flat, int64_t self,
                                               size_t rank_bytes, const std::vector<std::vector<int>>& remote_ranks) {
  std::vector<int64_t> all = flat.peers;
  all.push_back(self);
  const auto hosts = Hosts(world, all);
  if (!Worthwhile(hosts)) return nullptr;
  auto h = std::make_shared<Hierarchy>();
  const auto index_of = [&flat](int64_t q) {
    return static_cast<size_t>(std::find(flat.peers.begin(), flat.peers.end(), q) - flat.peers.begin());
  };
  // A sub-plan of the flat one: its own key and fingerprint, some of its peers; it
  // watches the others (ExchangePlan::watched) once they are all added.
  const auto sub = [&flat](uint64_t tag) {
    auto p = std::make_shared<ExchangePlan>();
    p->key = Mix(flat.key, tag);
    p->fingerprint = Mix(flat.fingerprint, tag);
    return p;
  };
  const auto watch_the_rest = [&flat](ExchangePlan& p) {
    for (size_t i = 0; i < flat.peers.size(); ++i) {
      if (std::find(p.peers.begin(), p.peers.end(), flat.peers[i]) != p.peers.end()) continue;
      p.watched.push_back(flat.peers[i]);
      p.watched_desc.push_back(flat.peer_desc[i]);
    }
  };
  const std::vector<int64_t>* mine = nullptr;
  for (size_t i = 0; i < hosts.size(); ++i) {
    if (std::find(hosts[i].begin(), hosts[i].end(), self) != hosts[i].end()) {
      mine = &hosts[i];
      h->host_index = i;
    }
  }
  const int64_t leader = mine->front();
  h->leader = leader == self;
  if (mine->size() > 1) {
    auto local = sub(0x686c6f63616cull);    // "hlocal"
    auto spread = sub(0x68737072656164ull);  // "hspread"
    for (int64_t q : *mine) {
      if (q == self) continue;
      const size_t i = index_of(q);
      local->peers.push_back(q);
      local->peer_bytes.push_back(rank_bytes * remote_ranks[i].size());
      local->peer_desc.push_back(flat.peer_desc[i]);
      h->local_ranks.push_back(remote_ranks[i].size());
      if (q == leader) h->leader_index = spread->peers.size();
      spread->peers.push_back(q);
      spread->peer_bytes.push_back(q == leader ? rank_bytes : 0);
      spread->peer_desc.push_back(flat.peer_desc[i] + " (the leader of this host)");
    }
    watch_the_rest(*local);
    watch_the_rest(*spread);
    h->local = std::move(local);
    h->spread = std::move(spread);
  }
  if (h->leader) {
    auto across = sub(0x6861637273737ull);  // "hacross"
    for (const auto& host : hosts) {
      const int64_t q = host.front();
      if (q == self) continue;
      const size_t i = index_of(q);
      across->peers.push_back(q);
      across->peer_bytes.push_back(rank_bytes);
      across->peer_desc.push_back(flat.peer_desc[i] + " (the leader of its host)");
    }
    watch_the_rest(*across);
    h->across = std::move(across);
  }
  return h;
}

void RoundTable::StartHierarchical(const std::shared_ptr<Round>& round, int me, std::shared_ptr<const Hierarchy> hierarchy,
                                   const Peer& shape) {
  // `local` lives as long as the table, which the round's instruction state keeps alive.
  const std::vector<int>& local = layouts_[round->group_index].local;
  std::make_shared<HierarchicalRound>(round, me, std::move(hierarchy), local, shape)->Start();
}

}  // namespace jaxcomm
