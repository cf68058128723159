#include "cpu/transport/factory.h"

#include "cpu/transport/mpi_transport.h"
#include "cpu/transport/shm_transport.h"
#include "cpu/transport/tcp_transport.h"

namespace jaxcomm::cpu {
namespace {

using Make = std::unique_ptr<Transport> (*)(const TransportContext&, const Params&, std::string*);

struct Kind {
  const char* name;
  Make make;
};

// Every transport of this build.
constexpr Kind kKinds[] = {
    {"shm", &ShmTransport::Make},
    {"tcp", &TcpTransport::Make},
    {"mpi", &MpiTransport::Make},
};

}  // namespace

std::unique_ptr<Transport> OpenTransport(const std::string& name, const TransportContext& context,
                                         const Params& settings, std::string* error) {
  for (const Kind& kind : kKinds) {
    if (name == kind.name) return kind.make(context, settings, error);
  }
  *error = "no transport named '" + name + "' in this build";
  return nullptr;
}

std::vector<std::string> TransportNames() {
  std::vector<std::string> names;
  for (const Kind& kind : kKinds) names.emplace_back(kind.name);
  return names;
}

}  // namespace jaxcomm::cpu
