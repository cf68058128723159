// The emulation's C++ test cases' one assertion: prints both sides and exits 1.
#pragma once

#include <cstdio>
#include <cstdlib>

#define EXPECT_EQ(a, b)                                                                            \
  do {                                                                                             \
    const long long va = static_cast<long long>(a), vb = static_cast<long long>(b);               \
    if (va != vb) {                                                                                \
      std::fprintf(stderr, "%s:%d: %s == %lld, expected %s == %lld\n", __FILE__, __LINE__, #a, va, \
                   #b, vb);                                                                        \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)
#define OK(x) EXPECT_EQ((x), cudaSuccess)
