# Finds what fsdpp builds on. Sets FSDPP_HAVE_GLOO, FSDPP_HAVE_NCCL and FSDPP_HAVE_NCCL_CORE.

# ---------------------------------------------------------------- LibTorch
include(${CMAKE_CURRENT_LIST_DIR}/fsdppFindTorch.cmake)
message(STATUS "fsdpp: LibTorch ${Torch_VERSION} at ${FSDPP_TORCH_ROOT}")

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

# fmt: the copy LibTorch carries (its headers sit among LibTorch's), used header-only, so that a
# process holds one fmt and loads no libfmt.so beside LibTorch.
find_path(FSDPP_FMT_INCLUDE_DIR fmt/format.h PATHS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
if(NOT FSDPP_FMT_INCLUDE_DIR)
  message(FATAL_ERROR "fsdpp: this LibTorch (${FSDPP_TORCH_ROOT}) carries no fmt headers (fmt/format.h)")
endif()
file(STRINGS "${FSDPP_FMT_INCLUDE_DIR}/fmt/base.h" _fmt_version REGEX "^#define FMT_VERSION ")
if(NOT _fmt_version)
  file(STRINGS "${FSDPP_FMT_INCLUDE_DIR}/fmt/core.h" _fmt_version REGEX "^#define FMT_VERSION ")
endif()
string(REGEX REPLACE ".*FMT_VERSION ([0-9]+).*" "\\1" FSDPP_TORCH_FMT_VERSION "${_fmt_version}")
fsdpp_header_dependency(nlohmann_json nlohmann_json::nlohmann_json nlohmann/json.hpp)
fsdpp_header_dependency(CLI11 CLI11::CLI11 CLI/CLI.hpp)

# SentencePiece (Debian's libsentencepiece-dev): the tokenizers of data.tokenizer and
# `fsdpp tokenizer train`. It keeps its own protobuf-lite to itself (no protobuf symbols exported),
# as LibTorch does its protobuf. Optional (FSDPP_WITH_SENTENCEPIECE): a GPU machine may have
# PyTorch but no Debian packages, and Debian's library may need a newer C library than it has;
# without it only the byte tokenizer is available (src/train/no_sentencepiece.cpp says so).
set(FSDPP_HAVE_SENTENCEPIECE OFF)
if(NOT FSDPP_WITH_SENTENCEPIECE STREQUAL "OFF")
  find_path(FSDPP_SENTENCEPIECE_INCLUDE_DIR sentencepiece_processor.h PATH_SUFFIXES include)
  find_library(FSDPP_SENTENCEPIECE_LIBRARY sentencepiece PATH_SUFFIXES lib)
  find_library(FSDPP_SENTENCEPIECE_TRAIN_LIBRARY sentencepiece_train PATH_SUFFIXES lib)
  if(FSDPP_SENTENCEPIECE_INCLUDE_DIR AND FSDPP_SENTENCEPIECE_LIBRARY AND FSDPP_SENTENCEPIECE_TRAIN_LIBRARY)
    set(FSDPP_HAVE_SENTENCEPIECE ON)
    add_library(SentencePiece::SentencePiece INTERFACE IMPORTED GLOBAL)
    target_include_directories(SentencePiece::SentencePiece INTERFACE ${FSDPP_SENTENCEPIECE_INCLUDE_DIR})
    target_link_libraries(SentencePiece::SentencePiece INTERFACE ${FSDPP_SENTENCEPIECE_TRAIN_LIBRARY}
                          ${FSDPP_SENTENCEPIECE_LIBRARY})
  elseif(FSDPP_WITH_SENTENCEPIECE STREQUAL "ON")
    message(FATAL_ERROR "FSDPP_WITH_SENTENCEPIECE=ON but SentencePiece was not found: install libsentencepiece-dev "
                        "(scripts/setup.sh) or put its headers and libraries on CMAKE_PREFIX_PATH")
  endif()
endif()
message(STATUS "fsdpp: SentencePiece ${FSDPP_HAVE_SENTENCEPIECE}")

# PCRE2 and utf8proc (Debian's libpcre2-dev, libutf8proc-dev): Hugging Face tokenizer.json files,
# their regular expressions and Unicode normal forms (src/train/text/). Optional as SentencePiece is
# (FSDPP_WITH_TOKENIZER_JSON); without them src/train/no_json_tokenizer.cpp says so at run time.
set(FSDPP_HAVE_TOKENIZER_JSON OFF)
if(NOT FSDPP_WITH_TOKENIZER_JSON STREQUAL "OFF")
  find_path(FSDPP_PCRE2_INCLUDE_DIR pcre2.h)
  find_library(FSDPP_PCRE2_LIBRARY pcre2-8)
  find_path(FSDPP_UTF8PROC_INCLUDE_DIR utf8proc.h)
  find_library(FSDPP_UTF8PROC_LIBRARY utf8proc)
  if(FSDPP_PCRE2_INCLUDE_DIR AND FSDPP_PCRE2_LIBRARY AND FSDPP_UTF8PROC_INCLUDE_DIR AND FSDPP_UTF8PROC_LIBRARY)
    set(FSDPP_HAVE_TOKENIZER_JSON ON)
    add_library(fsdpp::text_deps INTERFACE IMPORTED GLOBAL)
    target_include_directories(fsdpp::text_deps INTERFACE ${FSDPP_PCRE2_INCLUDE_DIR} ${FSDPP_UTF8PROC_INCLUDE_DIR})
    target_link_libraries(fsdpp::text_deps INTERFACE ${FSDPP_PCRE2_LIBRARY} ${FSDPP_UTF8PROC_LIBRARY})
  elseif(FSDPP_WITH_TOKENIZER_JSON STREQUAL "ON")
    message(FATAL_ERROR "FSDPP_WITH_TOKENIZER_JSON=ON but PCRE2 or utf8proc was not found: install libpcre2-dev and "
                        "libutf8proc-dev (scripts/setup.sh)")
  endif()
endif()
message(STATUS "fsdpp: tokenizer.json (PCRE2, utf8proc) ${FSDPP_HAVE_TOKENIZER_JSON}")

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
# ---------------------------------------------------------------- NCCL
# The NCCL backend needs the CUDA runtime, NCCL and a CUDA build of LibTorch (its streams, events
# and caching allocator). NCCL is the one LibTorch itself loads: the wheel's nvidia-nccl package
# beside torch/ (same soname, so the process holds one NCCL), else the CUDA toolkit's.
set(FSDPP_HAVE_NCCL_CORE OFF)
set(FSDPP_HAVE_NCCL OFF)
if(NOT FSDPP_WITH_NCCL STREQUAL "OFF")
  if(NOT CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    find_path(NCCL_INCLUDE_DIR nccl.h
      HINTS "${FSDPP_TORCH_ROOT}/../nvidia/nccl/include" ${CUDAToolkit_INCLUDE_DIRS})
    find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR
      HINTS "${FSDPP_TORCH_ROOT}/../nvidia/nccl/lib" ${CUDAToolkit_LIBRARY_DIR})
    if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
      set(FSDPP_HAVE_NCCL_CORE ON)
      file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_version REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
      string(REGEX REPLACE ".*MAJOR ([0-9]+).*MINOR ([0-9]+).*PATCH ([0-9]+).*" "\\1.\\2.\\3"
             FSDPP_NCCL_VERSION "${_nccl_version}")
    endif()
  endif()
  if(FSDPP_HAVE_NCCL_CORE AND (TARGET torch_cuda OR TORCH_CUDA_LIBRARIES))
    set(FSDPP_HAVE_NCCL ON)
  endif()
endif()
if(FSDPP_WITH_NCCL STREQUAL "ON" AND NOT FSDPP_HAVE_NCCL)
  message(FATAL_ERROR "FSDPP_WITH_NCCL=ON needs a CUDA build of LibTorch (this one is CPU-only: "
                      "point CMAKE_PREFIX_PATH at torch.utils.cmake_prefix_path of a CUDA PyTorch), the "
                      "CUDA toolkit (CUDAToolkit_ROOT) and NCCL (the nvidia-nccl wheel beside torch, the "
                      "toolkit's, or NCCL_INCLUDE_DIR/NCCL_LIBRARY)")
endif()
if(FSDPP_HAVE_NCCL)
  message(STATUS "fsdpp: NCCL backend ON: NCCL ${FSDPP_NCCL_VERSION} (${NCCL_LIBRARY}), CUDA ${CUDAToolkit_VERSION}")
else()
  message(STATUS "fsdpp: NCCL backend OFF")
endif()
