# Finds what fsdpp builds on. Sets FSDPP_HAVE_GLOO.
find_package(Torch REQUIRED)

# A header-only dependency: its CMake package where installed (Debian's -dev packages), otherwise
# its headers from the include path or CMAKE_PREFIX_PATH (a GPU host may have PyTorch but no Debian
# packages; scripts/gpu-check.sh passes a folder of headers).
function(fsdpp_header_dependency package target header)
  find_package(${package} QUIET ${ARGN})
  if(TARGET ${target})
    return()
  endif()
  string(MAKE_C_IDENTIFIER "${package}_HEADERS" var)
  find_path(${var} ${header} PATH_SUFFIXES include include/eigen3 eigen3)
  if(NOT ${var})
    message(FATAL_ERROR "fsdpp needs ${package} (${header}): install its Debian package (scripts/setup.sh) "
                        "or put its headers on CMAKE_PREFIX_PATH")
  endif()
  add_library(${target} INTERFACE IMPORTED GLOBAL)
  target_include_directories(${target} INTERFACE ${${var}})
endfunction()

fsdpp_header_dependency(fmt fmt::fmt fmt/format.h)
if(fmt_HEADERS)
  target_compile_definitions(fmt::fmt INTERFACE FMT_HEADER_ONLY=1)
endif()
fsdpp_header_dependency(nlohmann_json nlohmann_json::nlohmann_json nlohmann/json.hpp)
fsdpp_header_dependency(CLI11 CLI11::CLI11 CLI/CLI.hpp)

set(FSDPP_HAVE_GLOO OFF)
if(NOT FSDPP_WITH_GLOO STREQUAL "OFF")
  find_package(Gloo CONFIG QUIET)
  if(TARGET gloo)
    set(FSDPP_HAVE_GLOO ON)
  elseif(FSDPP_WITH_GLOO STREQUAL "ON")
    message(FATAL_ERROR "FSDPP_WITH_GLOO=ON but Gloo was not found (apt-get install libgloo-dev)")
  endif()
endif()
message(STATUS "fsdpp: Gloo backend ${FSDPP_HAVE_GLOO}")
# The NCCL backend's core needs only the CUDA runtime and NCCL, so it builds (and its test runs,
# down to the error path) wherever the CUDA toolkit is, GPU or not.
set(FSDPP_HAVE_NCCL_CORE OFF)
if(NOT FSDPP_WITH_NCCL STREQUAL "OFF")
  if(NOT CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
    if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
      set(FSDPP_HAVE_NCCL_CORE ON)
    endif()
  endif()
endif()
message(STATUS "fsdpp: NCCL core (CUDA runtime + NCCL, no LibTorch) ${FSDPP_HAVE_NCCL_CORE}")

# The backend itself also needs a CUDA build of LibTorch (its CUDA streams and caching allocator).
set(FSDPP_HAVE_NCCL OFF)
if(FSDPP_HAVE_NCCL_CORE AND (TARGET torch_cuda OR TORCH_CUDA_LIBRARIES))
  set(FSDPP_HAVE_NCCL ON)
elseif(FSDPP_WITH_NCCL STREQUAL "ON")
  message(FATAL_ERROR "FSDPP_WITH_NCCL=ON needs a CUDA build of LibTorch (this one is CPU-only: "
                      "point CMAKE_PREFIX_PATH at torch.utils.cmake_prefix_path of a CUDA PyTorch) and NCCL "
                      "(nccl.h and libnccl next to the CUDA toolkit or given as NCCL_INCLUDE_DIR/NCCL_LIBRARY)")
endif()
message(STATUS "fsdpp: NCCL backend ${FSDPP_HAVE_NCCL}")
