// jaxcomm.stats()'s counters as Python dicts, one per flight recorder site: shared by the
// two extension modules that record calls, _jaxcomm (ffi/module.cc) and the emulated CUDA
// backend's _jaxcomm_emu (ffi/cuda_emu/module.cc), each over its own registry's recorder.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

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

}  // namespace jaxcomm
