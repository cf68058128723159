// jaxcomm.stats()'s counters as Python dicts, one per flight recorder site, and the
// recorder's dumps: shared by the two extension modules that record calls, _jaxcomm
// (ffi/module.cc) and the emulated CUDA backend's _jaxcomm_emu (ffi/cuda_emu/module.cc),
// each over its own registry's recorder.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>

#include "core/flight_recorder.h"

namespace jaxcomm {

inline nanobind::list TraceStatsRows(FlightRecorder& recorder) {
  nanobind::list out;
  for (const TraceSite* s : recorder.Sites()) {
    nanobind::dict d;
    d["op"] = s->op;
    d["axis"] = s->axis;
    d["call_site"] = s->call_site;
    d["group"] = s->group;
    d["processes"] = s->processes;
    d["algorithm"] = s->algorithm;
    d["calls"] = s->calls.load();
    d["failed"] = s->failed.load();
    d["bytes"] = s->bytes.load();
    d["busy_us"] = s->busy_us.load();
    d["wait_us"] = s->wait_us.load();
    out.append(d);
  }
  return out;
}

// trace_json, trace_dump, trace_file_in and trace_auto_dumps over `recorder` (jaxcomm.trace).
inline void BindTraceDumps(nanobind::module_& m, FlightRecorder& recorder) {
  namespace nb = nanobind;
  FlightRecorder* rec = &recorder;  // lives as long as the process (the registry's)
  m.def("trace_json", [rec](const std::string& reason) {
    std::string json;
    {
      nb::gil_scoped_release release;
      json = rec->DumpJson(reason);
    }
    return json;
  }, nb::arg("reason"), "This process's flight recorder as a JSON document (see docs/tracing.md).");

  m.def("trace_dump", [rec](const std::string& path, const std::string& reason) {
    std::string error;
    {
      nb::gil_scoped_release release;
      error = rec->DumpToFile(path, reason);
    }
    if (!error.empty()) throw std::runtime_error("jaxcomm: flight recorder dump: " + error);
  }, nb::arg("path"), nb::arg("reason"), "Writes the flight recorder's JSON to `path` atomically.");

  m.def("trace_file_in", [rec](const std::string& dir) { return rec->FileIn(dir); },
        "This process's dump file name in `dir` (jaxcomm-trace-p<index>-<pid>[-<tag>].json).");

  m.def("trace_auto_dumps", [rec] { return rec->auto_dumps(); },
        "How many automatic dumps (errors, SIGUSR1) the dumper thread wrote.");
}

}  // namespace jaxcomm
