# Finds LibTorch (2.11 or newer) for fsdpp's build and for projects that use an installed fsdpp
# (fsdppConfig.cmake includes this file). Sets FSDPP_TORCH_ROOT (the torch/ directory) and, as
# find_package(Torch) does, TORCH_LIBRARIES.
#
# LibTorch is found in this order:
#  1. where the user points: -DTorch_DIR=... or -DCMAKE_PREFIX_PATH=... (a LibTorch zip or any
#     PyTorch's torch.utils.cmake_prefix_path);
#  2. the PyTorch of FSDPP_PYTHON, by default the virtual environment scripts/setup.sh fills
#     ($FSDPP_VENV, else ~/.cache/fsdpp/venv).
if(DEFINED ENV{FSDPP_VENV})
  set(_fsdpp_venv "$ENV{FSDPP_VENV}")
else()
  set(_fsdpp_venv "$ENV{HOME}/.cache/fsdpp/venv")
endif()
set(FSDPP_PYTHON "${_fsdpp_venv}/bin/python" CACHE FILEPATH
    "Python whose PyTorch provides LibTorch, safetensors and the reference implementations")
# A CUDA LibTorch's config looks for nvcc (CUDA_HOME) and, without an architecture list, runs a
# program to detect the GPUs; fsdpp compiles no CUDA kernels, so any list serves (Hopper's here).
if(NOT DEFINED ENV{CUDA_HOME} AND EXISTS /usr/local/cuda)
  set(ENV{CUDA_HOME} /usr/local/cuda)
endif()
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST 9.0)
endif()
find_package(Torch 2.11 QUIET)
if(NOT Torch_FOUND)
  if(NOT EXISTS "${FSDPP_PYTHON}")
    message(FATAL_ERROR "fsdpp needs LibTorch 2.11 or newer: run scripts/setup.sh (it installs PyTorch "
                        "2.15 into ${_fsdpp_venv}), or point -DFSDPP_PYTHON at a Python with PyTorch, or "
                        "-DCMAKE_PREFIX_PATH at a LibTorch")
  endif()
  execute_process(COMMAND "${FSDPP_PYTHON}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
                  OUTPUT_VARIABLE _fsdpp_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
                  ERROR_VARIABLE _fsdpp_torch_error RESULT_VARIABLE _fsdpp_torch_rc)
  if(NOT _fsdpp_torch_rc EQUAL 0)
    message(FATAL_ERROR "fsdpp: ${FSDPP_PYTHON} cannot import torch (${_fsdpp_torch_error}); run scripts/setup.sh")
  endif()
  find_package(Torch 2.11 REQUIRED PATHS "${_fsdpp_torch_prefix}" NO_DEFAULT_PATH)
endif()
get_filename_component(FSDPP_TORCH_ROOT "${Torch_DIR}/../../.." ABSOLUTE)

# A CUDA wheel's LibTorch loads the CUDA libraries of its nvidia-* packages (beside torch/, found
# through its RPATH), while its CMake config links the toolkit's (CUDAToolkit: /usr/local/cuda,
# possibly an older minor version). They share sonames, so whichever a process finds first is the
# only one it loads. Link the wheel's, so that the process loads the libraries LibTorch was built
# with and the link sees the same NCCL and CUDA runtime as LibTorch does.
file(GLOB _fsdpp_wheel_cuda_dirs LIST_DIRECTORIES true "${FSDPP_TORCH_ROOT}/../nvidia/*/lib")
foreach(_lib cudart nvrtc cuda_driver cublas cublasLt cufft curand cusparse cusolver cupti nvJitLink)
  if(NOT TARGET CUDA::${_lib} OR NOT _fsdpp_wheel_cuda_dirs)
    continue()
  endif()
  set(_wheel_lib)
  foreach(_dir ${_fsdpp_wheel_cuda_dirs})
    file(GLOB _candidates "${_dir}/lib${_lib}.so.[0-9]*")
    list(FILTER _candidates INCLUDE REGEX "\\.so\\.[0-9]+$")  # the soname file, libX.so.N
    if(_candidates)
      list(GET _candidates 0 _wheel_lib)
      break()
    endif()
  endforeach()
  if(_wheel_lib)
    set_target_properties(CUDA::${_lib} PROPERTIES IMPORTED_LOCATION "${_wheel_lib}")
  endif()
endforeach()
# NVRTC is named by file, not target, in TORCH_LIBRARIES and caffe2::nvrtc_runtime.
if(CUDA_NVRTC_LIB AND TARGET CUDA::nvrtc)
  get_target_property(_wheel_nvrtc CUDA::nvrtc IMPORTED_LOCATION)
  set(_libs)
  foreach(_l ${TORCH_LIBRARIES})
    if(_l STREQUAL CUDA_NVRTC_LIB)
      set(_l "${_wheel_nvrtc}")
    endif()
    list(APPEND _libs "${_l}")
  endforeach()
  set(TORCH_LIBRARIES ${_libs})
  if(TARGET caffe2::nvrtc_runtime)
    set_target_properties(caffe2::nvrtc_runtime PROPERTIES INTERFACE_LINK_LIBRARIES CUDA::nvrtc)
  endif()
endif()

