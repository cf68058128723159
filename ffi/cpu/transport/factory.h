// The one place that knows every transport of this build by name: World (world.h) opens
// the ones the bootstrap asks for through it. Adding a transport: its files (a Transport,
// transport.h) and one line in factory.cc.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cpu/transport/transport.h"

namespace jaxcomm::cpu {

// What every transport is made with.
struct TransportContext {
  int64_t process = -1;         // this process's index in the job
  std::function<void()> wake;   // wakes World's progress thread (data arrived, a link failed)
};

// Opens transport `name` with `settings` (its own fields, from the bootstrap); nullptr and
// `error` on failure, or for a name this build does not have.
std::unique_ptr<Transport> OpenTransport(const std::string& name, const TransportContext& context,
                                         const Params& settings, std::string* error);

// The names OpenTransport knows.
std::vector<std::string> TransportNames();

}  // namespace jaxcomm::cpu
