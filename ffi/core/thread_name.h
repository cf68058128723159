// Names jaxcomm's own threads, so that `top -H`, perf and gdb tell them from XLA's.
#pragma once

#include <pthread.h>

namespace jaxcomm {

// `name`: at most 15 characters (Linux's limit); a longer one is ignored.
inline void NameThisThread(const char* name) {
#if defined(__linux__)
  pthread_setname_np(pthread_self(), name);
#else
  (void)name;
#endif
}

}  // namespace jaxcomm
