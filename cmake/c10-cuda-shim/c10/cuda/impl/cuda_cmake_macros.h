#pragma once
// Stands in for the header a CUDA build of LibTorch generates, so that the NCCL backend's LibTorch
// glue compiles (and cannot rot) against the c10/cuda headers of a CPU-only LibTorch. The objects
// built with it are never linked.
