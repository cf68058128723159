// A round over processes on several hosts, in three phases instead of every process
// sending its operands to every other:
//   1. local:  the processes of each host exchange their operands (shared memory);
//   2. across: the hosts' leaders (their lowest process index) exchange, over TCP,
//              reductions: their host's result, which each leader combines in host
//              order, so that every leader gets the same bits;
//              other ops (a relay): their host's bundle of operands;
//   3. spread: each leader hands the result (relay: the other hosts' bundles) to the
//              other processes of its host, which then run the op's work as usual.
// What crosses between two hosts drops from (processes per host)^2 copies of an operand
// to one. (Large calls of ops whose ranks read only part of the operands send directly
// instead: see MayRunInPhases.) Each phase is an exchange (core/cross_process.h) with its own
// plan, deadline and errors; a phase's continuation never runs on the transport's
// progress thread.
#include <algorithm>
#include <cstring>
#include <map>

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
  HierarchicalRound(std::shared_ptr<Round> round, std::shared_ptr<const WorkFn> work, int me,
                    std::shared_ptr<const Hierarchy> h, const std::vector<int>& local,
                    const std::vector<std::vector<int>>& remote, const Peer& shape)
      : round_(std::move(round)), work_(std::move(work)), me_(me), h_(std::move(h)), local_(local),
        remote_(remote), shape_(shape), world_(Registry::Get().cross_process()), seq_(round_->execution),
        deadline_(Clock::now() + round_->timeout) {
    // This process's contribution, as the flat exchange sends it.
    for (int r : local_) AppendOperands(round_->peers[r], {0, static_cast<size_t>(shape_.elements)}, mine_);
  }

  void Start() {
    const Next next = h_->relay ? &HierarchicalRound::Gathered : &HierarchicalRound::Reduced;
    if (!h_->relay) Registry::Get().recorder().Start(round_->peers);
    if (!h_->local) return ((*this).*next)({});
    Phase(h_->local, mine_, next);
  }

 private:
  using Next = void (HierarchicalRound::*)(const std::vector<const char*>&);

  // Runs exchange `plan`, then `next` with the peers' contributions (ExchangeThen).
  void Phase(const std::shared_ptr<const ExchangePlan>& plan, std::vector<std::pair<const void*, size_t>> mine,
             Next next) {
    ExchangeSpec spec;
    spec.plan = plan;
    spec.seq = seq_;
    spec.mine = std::move(mine);
    spec.deadline = deadline_;
    ExchangeThen(*world_, std::move(spec), round_, me_,
                 [self = shared_from_this(), next](const std::vector<const char*>& blobs, int) {
                   ((*self).*next)(blobs);
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

  // Relay, after phase 1: leaders send their host's bundle to the other leaders.
  void Gathered(const std::vector<const char*>& blobs) {
    local_blobs_ = blobs;
    if (!h_->leader) return Phase(h_->spread, {}, &HierarchicalRound::Relayed);
    std::vector<std::pair<const void*, size_t>> bundle;
    for (int q : h_->bundle) {
      if (q < 0) {
        bundle.insert(bundle.end(), mine_.begin(), mine_.end());
      } else {
        bundle.emplace_back(blobs[q], h_->local->peer_bytes[q]);
      }
    }
    Phase(h_->across, std::move(bundle), &HierarchicalRound::Crossed);
  }

  // Relay, after phase 2 (leaders): the other hosts' bundles go to this host.
  void Crossed(const std::vector<const char*>& blobs) {
    across_blobs_ = blobs;
    if (!h_->spread) return Relayed({});
    std::vector<std::pair<const void*, size_t>> others;
    for (size_t i = 0; i < blobs.size(); ++i) others.emplace_back(blobs[i], h_->across->peer_bytes[i]);
    Phase(h_->spread, std::move(others), &HierarchicalRound::Relayed);
  }

  // Relay, after phase 3: every process's operands are here; the op's work runs as in a
  // flat round, and the phases are released once it has read them.
  void Relayed(const std::vector<const char*>& blobs) {
    const std::vector<const char*>* phases[3] = {&local_blobs_, &across_blobs_, &blobs};
    std::vector<const char*> operands;
    for (const Hierarchy::Source& src : h_->sources) operands.push_back((*phases[src.phase])[src.index] + src.offset);
    PlaceRemoteOperands(*round_, remote_, shape_, operands);
    round_->after_work = [world = world_, h = h_, seq = seq_] {
      for (const auto* plan : {h->local.get(), h->across.get(), h->spread.get()}) {
        if (plan) world->Release(*plan, seq);
      }
    };
    Execute(round_, work_, me_);
  }

  std::shared_ptr<Round> round_;
  std::shared_ptr<const WorkFn> work_;
  int me_;
  std::shared_ptr<const Hierarchy> h_;
  const std::vector<int>& local_;                // this process's ranks
  const std::vector<std::vector<int>>& remote_;  // the other processes' (flat plan order)
  Peer shape_;
  std::vector<std::pair<const void*, size_t>> mine_;
  std::vector<const char*> local_blobs_, across_blobs_;
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
                                               size_t rank_bytes, size_t my_ranks,
                                               const std::vector<std::vector<int>>& remote_ranks, bool relay) {
  std::vector<int64_t> all = flat.peers;
  all.push_back(self);
  const auto hosts = Hosts(world, all);
  if (!Worthwhile(hosts)) return nullptr;
  auto h = std::make_shared<Hierarchy>();
  h->relay = relay;
  const auto index_of = [&flat](int64_t q) {
    return static_cast<size_t>(std::find(flat.peers.begin(), flat.peers.end(), q) - flat.peers.begin());
  };
  // A sub-plan of the flat one: its own key and fingerprint, some of its peers; it
  // watches the others (ExchangePlan::watched) once they are all added.
  const auto sub = [&flat](uint64_t tag) {
    auto p = std::make_shared<ExchangePlan>();
    p->key = Mix(flat.key, tag);
    p->fingerprint = Mix(flat.fingerprint, tag);
    p->op = flat.op;
    p->call_site = flat.call_site;
    p->ranks = flat.ranks;
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
  // Relay: what each process contributes, and each host's bundle.
  const auto bytes_of = [&](int64_t q) {
    return rank_bytes * (q == self ? my_ranks : remote_ranks[index_of(q)].size());
  };
  std::vector<size_t> bundle_bytes;
  for (const auto& host : hosts) {
    size_t b = 0;
    for (int64_t q : host) b += bytes_of(q);
    bundle_bytes.push_back(b);
  }
  size_t others_bytes = 0;  // what the spread phase carries in a relay
  for (size_t i = 0; i < hosts.size(); ++i) others_bytes += i == h->host_index ? 0 : bundle_bytes[i];
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
      spread->peer_bytes.push_back(q != leader ? 0 : relay ? others_bytes : rank_bytes);
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
      across->peer_bytes.push_back(relay ? bundle_bytes[static_cast<size_t>(&host - hosts.data())] : rank_bytes);
      across->peer_desc.push_back(flat.peer_desc[i] + " (the leader of its host)");
    }
    watch_the_rest(*across);
    h->across = std::move(across);
  }
  if (!relay) return h;
  for (int64_t q : *mine) {
    h->bundle.push_back(q == self ? -1 : static_cast<int>(std::find(h->local->peers.begin(), h->local->peers.end(), q) -
                                                          h->local->peers.begin()));
  }
  for (int64_t q : flat.peers) {
    Hierarchy::Source src;
    size_t host = 0, offset = 0;  // q's host, and q's place in its bundle
    for (size_t i = 0; i < hosts.size(); ++i) {
      auto it = std::find(hosts[i].begin(), hosts[i].end(), q);
      if (it == hosts[i].end()) continue;
      host = i;
      for (auto p = hosts[i].begin(); p != it; ++p) offset += bytes_of(*p);
    }
    if (host == h->host_index) {
      src = {0, static_cast<size_t>(std::find(h->local->peers.begin(), h->local->peers.end(), q) - h->local->peers.begin()), 0};
    } else if (h->leader) {
      // The other leaders in host order, this host left out.
      src = {1, host - (host > h->host_index ? 1 : 0), offset};
    } else {
      size_t before = 0;  // the bundles ahead of q's in the spread, this host's left out
      for (size_t i = 0; i < host; ++i) before += i == h->host_index ? 0 : bundle_bytes[i];
      src = {2, h->leader_index, before + offset};
    }
    h->sources.push_back(src);
  }
  return h;
}

void RoundTable::StartHierarchical(const std::shared_ptr<Round>& round, std::shared_ptr<const WorkFn> work, int me,
                                   std::shared_ptr<const Hierarchy> hierarchy, const Peer& shape) {
  // The layout lives as long as the table, which the round's instruction state keeps alive.
  const Layout& layout = layouts_[round->group_index];
  std::make_shared<HierarchicalRound>(round, std::move(work), me, std::move(hierarchy), layout.local, layout.remote,
                                      shape)
      ->Start();
}

}  // namespace jaxcomm
