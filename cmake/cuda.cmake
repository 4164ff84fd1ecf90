# CUDA backend: built when nvcc is present (SHARDTRAIN_CUDA=AUTO) or forced ON.
# The CPU-only build needs no CUDA toolkit at all.
set(SHARDTRAIN_HAVE_CUDA OFF)
if(NOT SHARDTRAIN_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER AND EXISTS "${CMAKE_SOURCE_DIR}/src/backend/cuda")
    file(GLOB_RECURSE _cuda_sources CONFIGURE_DEPENDS
      "${CMAKE_SOURCE_DIR}/src/*.cu" "${CMAKE_SOURCE_DIR}/src/*_cuda.cpp"
      "${CMAKE_SOURCE_DIR}/src/backend/cuda/*.cpp")
    if(_cuda_sources)
      set(SHARDTRAIN_HAVE_CUDA ON)
    endif()
  elseif(SHARDTRAIN_CUDA STREQUAL "ON")
    message(FATAL_ERROR "SHARDTRAIN_CUDA=ON but no CUDA compiler was found: install the CUDA toolkit "
                        "or configure with -DSHARDTRAIN_CUDA=OFF")
  endif()
endif()
message(STATUS "shardtrain CUDA backend: ${SHARDTRAIN_HAVE_CUDA}")
if(SHARDTRAIN_HAVE_CUDA)
  # sm_90a machine code for Hopper (H100/H200) plus compute_90 PTX for newer GPUs. Set before
  # enable_language(), which would otherwise pick nvcc's default (sm_75: Hopper would then run
  # JIT-compiled sm_75-level code). Override with -DCMAKE_CUDA_ARCHITECTURES=... or $CUDAARCHS.
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
    set(CMAKE_CUDA_ARCHITECTURES "90a-real;90-virtual")
  endif()
  enable_language(CUDA)
  # CMake 3.25's tables stop before nvcc 13: tell it how nvcc selects C++20.
  if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA_STANDARD_COMPUTED_DEFAULT 17)
  endif()
  find_package(CUDAToolkit REQUIRED)
  add_library(shardtrain_cuda STATIC ${_cuda_sources})
  target_include_directories(shardtrain_cuda PUBLIC "${CMAKE_SOURCE_DIR}/src")
  set_target_properties(shardtrain_cuda PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON
                                                   CUDA_SEPARABLE_COMPILATION OFF
                                                   POSITION_INDEPENDENT_CODE ON)
  target_compile_options(shardtrain_cuda PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -Xcompiler=-Wall,-Wextra>)
  find_library(SHARDTRAIN_NCCL NAMES nccl HINTS ${CUDAToolkit_LIBRARY_DIR} REQUIRED)
  find_path(SHARDTRAIN_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} REQUIRED)
  target_include_directories(shardtrain_cuda PUBLIC "${SHARDTRAIN_NCCL_INCLUDE}")
  # cuDNN (convolution for the image models): part of the CUDA toolkit install here; on the GPU
  # machines it also comes with PyTorch's nvidia-cudnn wheel.
  find_library(SHARDTRAIN_CUDNN NAMES cudnn HINTS ${CUDAToolkit_LIBRARY_DIR} REQUIRED)
  find_path(SHARDTRAIN_CUDNN_INCLUDE cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS} REQUIRED)
  target_include_directories(shardtrain_cuda PUBLIC "${SHARDTRAIN_CUDNN_INCLUDE}")
  target_link_libraries(shardtrain_cuda PUBLIC CUDA::cudart CUDA::cublasLt CUDA::cublas
                                               ${SHARDTRAIN_NCCL} ${SHARDTRAIN_CUDNN} fmt::fmt
                                               nlohmann_json::nlohmann_json)
  target_link_libraries(shardtrain_lib PUBLIC shardtrain_cuda)
  # `shardtrain env` names the architectures compiled in (backend/cuda/cuda_info.cpp).
  string(REPLACE ";" "," _shardtrain_archs "${CMAKE_CUDA_ARCHITECTURES}")
  set_source_files_properties("${CMAKE_SOURCE_DIR}/src/backend/cuda/cuda_info.cpp" PROPERTIES
    COMPILE_DEFINITIONS "SHARDTRAIN_CUDA_ARCHS=\"${_shardtrain_archs}\"")
  target_compile_definitions(shardtrain_lib PUBLIC SHARDTRAIN_WITH_CUDA=1)
endif()
