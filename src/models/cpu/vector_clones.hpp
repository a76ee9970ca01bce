#pragma once
// FSDPP_VECTOR_CLONES before a function compiles it for AVX-512, AVX2 and baseline x86-64, the best
// one picked when the library loads (an ifunc): the library itself is built for baseline x86-64,
// and the loops of the model's kernels are where wider vectors pay. The files using it are
// compiled with -O3 (see CMakeLists.txt), whose vectoriser takes the loops -O2's leaves scalar.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FSDPP_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FSDPP_VECTOR_CLONES
#endif
