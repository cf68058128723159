#include "core/mismatch.h"

#include <algorithm>
#include <sstream>

#include "core/registry.h"

namespace jaxcomm {

std::chrono::milliseconds MismatchGrace(std::chrono::milliseconds timeout) {
  return std::min(Registry::Get().mismatch_grace(), timeout / 10);
}

std::string MismatchMessage(const std::vector<MismatchSide>& sides, std::chrono::milliseconds grace,
                            bool processes) {
  std::ostringstream s;
  s << "MISMATCH: ";
  std::vector<const MismatchSide*> order;  // this call's side first
  for (const MismatchSide& side : sides) {
    if (side.here) order.push_back(&side);
  }
  for (const MismatchSide& side : sides) {
    if (!side.here) order.push_back(&side);
  }
  for (const MismatchSide* p : order) {
    const MismatchSide& side = *p;
    s << side.who << (processes ? " waits in " : " wait in ") << side.op << " at " << side.call_site
      << " (execution #" << side.execution << (side.here ? ", this call" : "") << "); ";
  }
  s << "each side waits for the other, for longer than the grace period (" << grace.count() / 1000.0
    << " s, JAXCOMM_MISMATCH_GRACE_S): the " << (processes ? "processes" : "ranks")
    << " run different collectives at this step (a different op or call site, a lax.cond or "
       "switch whose branch differs by rank, or jitted programs dispatched in different orders)";
  return s.str();
}

namespace {

bool Meet(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  for (int64_t x : a) {
    if (std::find(b.begin(), b.end(), x) != b.end()) return true;
  }
  return false;
}

// Which waits `from` reaches by "waits for a partition arrived there".
std::vector<bool> Reach(const std::vector<LocalWait>& waits, const std::vector<bool>& ripe, size_t from) {
  std::vector<bool> seen(waits.size(), false);
  std::vector<size_t> todo{from};
  while (!todo.empty()) {
    const size_t x = todo.back();
    todo.pop_back();
    for (size_t y = 0; y < waits.size(); ++y) {
      if (y == x || seen[y] || !ripe[y] || !Meet(waits[x].missing, waits[y].arrived)) continue;
      seen[y] = true;
      todo.push_back(y);
    }
  }
  return seen;
}

}  // namespace

std::vector<size_t> FindCycle(const std::vector<LocalWait>& waits, size_t self,
                              std::chrono::steady_clock::time_point now) {
  std::vector<bool> ripe(waits.size());
  for (size_t i = 0; i < waits.size(); ++i) {
    ripe[i] = waits[i].grace.count() > 0 && now - waits[i].since >= waits[i].grace;
  }
  if (!ripe[self]) return {};
  // Every member of the cycle: the waits self reaches that reach it back.
  const auto cycle_of = [&](const std::vector<bool>& counted) {
    const std::vector<bool> from_self = Reach(waits, counted, self);
    std::vector<size_t> cycle{self};
    for (size_t y = 0; y < waits.size(); ++y) {
      if (y != self && from_self[y] && Reach(waits, counted, y)[self]) cycle.push_back(y);
    }
    return cycle;
  };
  if (cycle_of(ripe).size() == 1) return {};
  // A cycle of waits past their grace period: a deadlock. Rounds in it that began later
  // (their ranks arrived after the others') belong to it all the same: failing only the
  // ripe ones would leave them waiting for ranks that never come.
  return cycle_of(std::vector<bool>(waits.size(), true));
}

}  // namespace jaxcomm
