#pragma once
// Note [MKL vector math's first calls]
// ATen sends float and double unary operators on CPU tensors (cos, sin, exp, log, sqrt, tanh, erf,
// ...) to MKL's vector math (vmsCos, vmdExp, ...; ATen/cpu/vml.h), and MKL picks each function's
// kernel at that function's first call in the process. Two threads making that first call at once
// can leave one of them on a less accurate kernel for that one call (pytorch/pytorch#188792, seen
// with the oneMKL 2024.2 that PyTorch's x86 wheels carry). cpu.microbatch_threads=2 met it:
// both threads' first forwards compute their rotary tables' cosines at about the same moment, and
// in about one run in sixty one thread's table came out different in its last bits, and with it
// the run's parameters. ATen's own intra-op threads meet it the same way on a first operator large
// enough to split. Calling every such function once, on one thread, before any other thread runs
// ATen operators, makes each choice before the threads can race for it.

namespace fsdpp {

// Calls each of the vector-math functions ATen sends float and double unary operators to, once
// per process (later calls return at once), through the ATen operators that use them. fsdpp's
// trainer and `fsdpp generate` call it before their first threads compute; a program of its own
// that runs ATen operators on several threads, or with intra-op threads, calls it at its start.
void resolve_mkl_vml_kernels();

namespace detail {
// The calls themselves, every time (tests count them).
void call_mkl_vml_functions();
}  // namespace detail

}  // namespace fsdpp
