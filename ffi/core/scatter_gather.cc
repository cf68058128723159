// A reduction over three or more processes linked with per-peer sends (TCP, MPI:
// LinkCapabilities::per_peer_sends), as a reduce-scatter then an
// all-gather instead of every process sending its operands to every other:
//   1. scatter: the elements are cut into one slice per process (the group's processes in
//               index order); each process sends every other process that process's
//               slice of its ranks' operands, and reduces its own slice over every rank
//               of the group, in rank order;
//   2. gather:  each process sends its reduced slice to every other, and writes every
//               slice into each of its ranks' results.
// Each process sends 2(P-1)/P operands' worth (per rank it holds, in phase 1) instead of
// P-1: 4 processes as 4 hosts, 16 MiB all_reduce, 48 MiB sent per process before, 24 MiB
// now. Each slice is reduced by one process only, so every rank gets the same bits.
// Each phase is an exchange (core/cross_process.h) with its own plan; a phase's
// continuation never runs on the transport's progress thread.
#include <algorithm>
#include <cstring>

#include "core/registry.h"
#include "core/round.h"

namespace jaxcomm {
namespace {

// Elements [lo, hi) of `elements` that the process at `index` of `count` owns.
ElementRange Slice(size_t elements, size_t index, size_t count) {
  return {elements * index / count, elements * (index + 1) / count};
}

size_t Length(ElementRange r) { return r.second - r.first; }

// One process's part in one round; owned by the exchanges' callbacks.
class ScatterGatherRound : public std::enable_shared_from_this<ScatterGatherRound> {
 public:
  ScatterGatherRound(std::shared_ptr<Round> round, int me, std::shared_ptr<const ScatterGather> sg,
                     const std::vector<int>& local, const std::vector<std::vector<int>>& remote, const Peer& shape)
      : round_(std::move(round)), me_(me), sg_(std::move(sg)), local_(local), remote_(remote), shape_(shape),
        item_(shape.item_bytes()), world_(Registry::Get().cross_process()), seq_(round_->execution),
        deadline_(Clock::now() + round_->timeout) {}

  void Start() {
    Registry::Get().recorder().Start(round_->peers);
    ExchangeSpec spec = Spec(sg_->scatter);
    // Peer i gets its slice of each of this process's ranks' operands, in rank order.
    spec.per_peer.resize(remote_.size());
    for (size_t i = 0; i < remote_.size(); ++i) {
      for (int r : local_) AppendOperands(round_->peers[r], sg_->peer_slices[i], spec.per_peer[i]);
    }
    Then(std::move(spec), &ScatterGatherRound::Scattered);
  }

 private:
  using Next = void (ScatterGatherRound::*)(const std::vector<const char*>&);

  ExchangeSpec Spec(const std::shared_ptr<const ExchangePlan>& plan) const {
    ExchangeSpec spec;
    spec.plan = plan;
    spec.seq = seq_;
    spec.deadline = deadline_;
    return spec;
  }

  void Then(ExchangeSpec spec, Next next) {
    ExchangeThen(*world_, std::move(spec), round_, me_,
                 [self = shared_from_this(), next](const std::vector<const char*>& blobs, int) {
                   ((*self).*next)(blobs);
                 });
  }

  char* Out(int r, size_t element) const { return static_cast<char*>(round_->peers[r].out) + element * item_; }

  // After phase 1: this process's slice, reduced over the group's ranks in rank order
  // into its first rank's result, then copied to its other ranks'.
  void Scattered(const std::vector<const char*>& blobs) {
    const ElementRange mine = sg_->slice;
    std::vector<const void*> in(round_->peers.size());
    for (int r : local_) in[r] = static_cast<const char*>(round_->peers[r].in) + mine.first * item_;
    for (size_t i = 0; i < remote_.size(); ++i) {
      for (size_t k = 0; k < remote_[i].size(); ++k) in[remote_[i][k]] = blobs[i] + k * Length(mine) * item_;
    }
    char* reduced = Out(local_.front(), mine.first);
    RecordError(*round_, (*round_->combine)(in, reduced, Length(mine)));
    for (size_t k = 1; k < local_.size(); ++k) std::memcpy(Out(local_[k], mine.first), reduced, Length(mine) * item_);
    world_->Release(*sg_->scatter, seq_);
    ExchangeSpec spec = Spec(sg_->gather);
    spec.mine = {{reduced, Length(mine) * item_}};
    Then(std::move(spec), &ScatterGatherRound::Gathered);
  }

  // After phase 2: the other processes' reduced slices, into every rank's result.
  void Gathered(const std::vector<const char*>& blobs) {
    for (size_t i = 0; i < blobs.size(); ++i) {
      const ElementRange theirs = sg_->peer_slices[i];
      for (int r : local_) std::memcpy(Out(r, theirs.first), blobs[i], Length(theirs) * item_);
    }
    world_->Release(*sg_->gather, seq_);
    CompleteAll(*round_, me_, ffi::ErrorCode::kInternal);
  }

  std::shared_ptr<Round> round_;
  int me_;
  std::shared_ptr<const ScatterGather> sg_;
  const std::vector<int>& local_;                // this process's ranks
  const std::vector<std::vector<int>>& remote_;  // the other processes' (flat plan order)
  Peer shape_;
  size_t item_;
  CrossProcess* world_;
  int64_t seq_;
  Clock::time_point deadline_;
};

}  // namespace

bool ScattersAndGathers(const CrossProcess& world, const std::vector<int64_t>& remote) {
  if (remote.size() < 2) return false;
  for (int64_t p : remote) {
    const LinkCapabilities* link = world.LinkOf(p);
    if (link == nullptr || !link->per_peer_sends) return false;
  }
  return true;
}

std::shared_ptr<const ScatterGather> PlanScatterGather(const ExchangePlan& flat, int64_t self, const Peer& shape,
                                                       const std::vector<std::vector<int>>& remote_ranks) {
  std::vector<int64_t> all = flat.peers;
  all.push_back(self);
  std::sort(all.begin(), all.end());
  const auto index_of = [&all](int64_t q) {
    return static_cast<size_t>(std::find(all.begin(), all.end(), q) - all.begin());
  };
  const size_t elements = static_cast<size_t>(shape.elements), item = shape.item_bytes();
  auto sg = std::make_shared<ScatterGather>();
  sg->slice = Slice(elements, index_of(self), all.size());
  auto scatter = std::make_shared<ExchangePlan>(flat);
  scatter->key = Mix(flat.key, 0x73736361747465ull);  // "sscatte"
  scatter->fingerprint = Mix(flat.fingerprint, 0x73736361747465ull);
  scatter->arrival = nullptr;  // neither streams nor tolerates faults
  scatter->agreement = nullptr;
  auto gather = std::make_shared<ExchangePlan>(*scatter);
  gather->key = Mix(flat.key, 0x73676174686572ull);  // "sgather"
  gather->fingerprint = Mix(flat.fingerprint, 0x73676174686572ull);
  for (size_t i = 0; i < flat.peers.size(); ++i) {
    const ElementRange theirs = Slice(elements, index_of(flat.peers[i]), all.size());
    sg->peer_slices.push_back(theirs);
    scatter->peer_bytes[i] = remote_ranks[i].size() * Length(sg->slice) * item;
    scatter->peer_desc[i] = flat.peer_desc[i] + " (reduce-scatter)";
    gather->peer_bytes[i] = Length(theirs) * item;
    gather->peer_desc[i] = flat.peer_desc[i] + " (all-gather)";
  }
  sg->scatter = std::move(scatter);
  sg->gather = std::move(gather);
  return sg;
}

void RoundTable::StartScatterGather(const std::shared_ptr<Round>& round, int me,
                                    std::shared_ptr<const ScatterGather> sg, const Peer& shape) {
  // The layout lives as long as the table, which the round's instruction state keeps alive.
  const Layout& layout = layouts_[round->group_index];
  std::make_shared<ScatterGatherRound>(round, me, std::move(sg), layout.local, layout.remote, shape)->Start();
}

}  // namespace jaxcomm
