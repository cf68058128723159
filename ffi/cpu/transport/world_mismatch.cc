// World's side of the mismatch check (core/mismatch.h): what this process shows of its
// waits past the grace period, and what it makes of its peers'.
#include <algorithm>
#include <cstring>

#include "core/mismatch.h"
#include "cpu/transport/world_internal.h"

namespace jaxcomm::cpu {
namespace {

using Clock = std::chrono::steady_clock;

// How long a wait that failed as a mismatch stays on the board: its peer, which waited
// the grace period too, looks again within kLivenessPeriod, unless its machine is busy.
Clock::duration FailedNoticeLife(std::chrono::milliseconds grace) {
  return std::max<Clock::duration>(2 * grace + std::chrono::seconds(2), std::chrono::seconds(5));
}

// Calls refused at most (the newest kept).
constexpr size_t kMaxRefused = 64;

bool SameNotices(const std::vector<WaitNotice>& a, const std::vector<WaitNotice>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(WaitNotice)) == 0);
}

}  // namespace

WaitNotice World::NoticeOf(const Pending& p) const {
  const ExchangePlan& plan = *p.spec.plan;
  WaitNotice n;
  n.key = plan.key;
  n.seq = p.spec.seq;
  WaitNotice::Put(n.op, plan.op);
  WaitNotice::Put(n.call_site, plan.call_site);
  WaitNotice::Put(n.ranks, plan.ranks);
  for (size_t i = 0; i < plan.peers.size(); ++i) {
    if (!p.blobs[i] && !p.left_out[i]) n.Miss(plan.peers[i]);
  }
  return n;
}

std::string World::Refused(uint64_t key, int64_t seq) {
  std::lock_guard<std::mutex> lock(mismatch_mu_);
  auto it = refused_.find({key, seq});
  if (it == refused_.end()) return "";
  std::string why = std::move(it->second);
  refused_.erase(it);
  return why;
}

bool World::Mismatch(Pending& p, std::string* error) {
  const ExchangePlan& plan = *p.spec.plan;
  std::vector<MismatchSide> sides{{self_ + " with " + plan.ranks, plan.op, plan.call_site, p.spec.seq, true}};
  std::vector<WaitNotice> theirs;
  for (size_t i = 0; i < p.links.size(); ++i) {
    if (p.blobs[i] || p.left_out[i]) continue;
    PeerTransport& link = *p.links[i];
    for (const WaitNotice& n : link.Notices()) {
      if ((n.key == plan.key && n.seq == p.spec.seq) || !n.Misses(process_)) continue;
      if ((n.flags & WaitNotice::kFailed) != 0 && !n.Against(plan.key, p.spec.seq)) continue;
      // A notice sent before this process's contribution arrived there is stale.
      if (link.Delivered(n.key, n.seq)) continue;
      sides.push_back({link.Describe() + " with " + n.ranks, n.op, n.call_site, n.seq, false});
      theirs.push_back(n);
      break;
    }
  }
  if (theirs.empty()) return false;
  *error = MismatchMessage(sides, p.grace, /*processes=*/true);
  WaitNotice mine = NoticeOf(p);
  mine.flags |= WaitNotice::kFailed;
  for (size_t k = 0; k < theirs.size() && k < WaitNotice::kAgainst; ++k) {
    mine.against_key[k] = theirs[k].key;
    mine.against_seq[k] = theirs[k].seq;
  }
  std::lock_guard<std::mutex> lock(mismatch_mu_);
  failed_notices_.push_back({mine, Clock::now() + FailedNoticeLife(p.grace)});
  if (failed_notices_.size() > kMaxWaitNotices / 2) failed_notices_.erase(failed_notices_.begin());
  // Should this process reach a call a peer waits in, it fails there with the same
  // error (that call named as its own) instead of completing it: the peer then fails
  // as well, not only this process.
  for (size_t k = 0; k < theirs.size(); ++k) {
    for (size_t j = 0; j < sides.size(); ++j) sides[j].here = j == k + 1;
    refused_[{theirs[k].key, theirs[k].seq}] = MismatchMessage(sides, p.grace, true);
  }
  while (refused_.size() > kMaxRefused) refused_.erase(refused_.begin());
  any_refused_.store(true, std::memory_order_relaxed);
  show_now_.store(true, std::memory_order_relaxed);  // the failed notice, at once
  return true;
}

void World::ShowWaits(const std::vector<std::unique_ptr<Pending>>& mine, Clock::time_point now) {
  if (now < next_show_ && !show_now_.load(std::memory_order_relaxed)) return;
  show_now_.store(false, std::memory_order_relaxed);
  next_show_ = now + kLivenessPeriod;
  std::vector<WaitNotice> notices;
  for (const auto& p : mine) {
    if (p->grace.count() == 0 || now - p->start < p->grace || notices.size() == kMaxWaitNotices) continue;
    notices.push_back(NoticeOf(*p));
  }
  {
    std::lock_guard<std::mutex> lock(mismatch_mu_);
    failed_notices_.erase(std::remove_if(failed_notices_.begin(), failed_notices_.end(),
                                         [now](const FailedNotice& f) { return f.until <= now; }),
                          failed_notices_.end());
    for (const FailedNotice& f : failed_notices_) {
      if (notices.size() < kMaxWaitNotices) notices.push_back(f.notice);
    }
  }
  if (SameNotices(notices, shown_)) return;
  shown_ = notices;
  for (Transport* transport : transports_) transport->ShowWaits(notices);
  // Peers that cannot read them there are sent them: those some notice waits for, and
  // those that were shown one before (their view must be cleared).
  Links links;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [q, link] : peers_) links.push_back(link);
  }
  std::set<int64_t> told;
  for (const auto& link : links) {
    const int64_t q = link->peer.process;
    const bool waited_for =
        std::any_of(notices.begin(), notices.end(), [q](const WaitNotice& n) { return n.Misses(q); });
    if (!waited_for && !told_.count(q)) continue;
    // Best effort: a link that cannot take a few KiB within a second is failing anyway.
    if (link->ShowWaits(notices, now + std::chrono::seconds(1)).empty() && waited_for) told.insert(q);
  }
  told_ = std::move(told);
}

}  // namespace jaxcomm::cpu
