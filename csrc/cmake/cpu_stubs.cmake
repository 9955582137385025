# fxrt_cpu_stub_definitions(<var>): the compile definitions under which fxrt's own ops may call
# ATen's CPU kernels through their DispatchStubs (fxrt/_speedups/own_ops.h) with the installed
# libtorch: the CPU-capability macros torch was built with, and FXRT_CPU_STUBS. Empty when no
# known set links (own_ops.h then calls the ATen ops instead). See
# fxrt/_speedups/cpu_stubs_probe.cpp for why a link, not the architecture, decides. The answer
# is cached per libtorch.
function(fxrt_cpu_stub_definitions out)
  set(key "${TORCH_INSTALL_PREFIX};${Torch_VERSION};${CMAKE_CXX_COMPILER}")
  if(DEFINED FXRT_CPU_STUBS_KEY AND FXRT_CPU_STUBS_KEY STREQUAL key)
    set(${out} "${FXRT_CPU_STUBS_DEFINITIONS}" PARENT_SCOPE)
    return()
  endif()
  set(candidates
    "HAVE_AVX512_CPU_DEFINITION=1,HAVE_AVX2_CPU_DEFINITION=1"
    "HAVE_SVE_CPU_DEFINITION=1"
    "HAVE_AVX2_CPU_DEFINITION=1"
    "HAVE_VSX_CPU_DEFINITION=1"
    "HAVE_ZVECTOR_CPU_DEFINITION=1"
    "")
  if(CMAKE_SYSTEM_PROCESSOR MATCHES "aarch64|arm64|ARM64")
    list(REMOVE_AT candidates 1)
    list(INSERT candidates 0 "HAVE_SVE_CPU_DEFINITION=1")
  endif()
  set(probe "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/../../fxrt/_speedups/cpu_stubs_probe.cpp")
  # The libraries themselves, not torch's imported targets (whose link interfaces name targets a
  # probe project does not have).
  find_library(FXRT_TORCH_CPU_LIBRARY torch_cpu PATHS "${TORCH_INSTALL_PREFIX}/lib" NO_DEFAULT_PATH)
  find_library(FXRT_C10_LIBRARY c10 PATHS "${TORCH_INSTALL_PREFIX}/lib" NO_DEFAULT_PATH)
  separate_arguments(torch_flags UNIX_COMMAND "${TORCH_CXX_FLAGS}")
  set(found "")
  set(ok FALSE)
  set(index 0)
  foreach(candidate IN LISTS candidates)
    string(REPLACE "," ";" defs "${candidate}")
    set(flags "")
    foreach(d IN LISTS defs)
      list(APPEND flags "-D${d}")
    endforeach()
    try_compile(linked "${CMAKE_BINARY_DIR}/fxrt_cpu_stubs/${index}"
      SOURCES "${probe}"
      CMAKE_FLAGS "-DINCLUDE_DIRECTORIES=${TORCH_INCLUDE_DIRS}"
      COMPILE_DEFINITIONS ${flags} ${torch_flags}
      LINK_LIBRARIES ${FXRT_TORCH_CPU_LIBRARY} ${FXRT_C10_LIBRARY}
      CXX_STANDARD 20
      OUTPUT_VARIABLE log)
    math(EXPR index "${index} + 1")
    if(linked)
      set(found ${defs} FXRT_CPU_STUBS=1)
      set(ok TRUE)
      break()
    endif()
  endforeach()
  if(ok)
    message(STATUS "fxrt: ATen's CPU DispatchStubs link with: ${found}")
  else()
    message(STATUS "fxrt: no known DispatchStub declaration links with this libtorch; fxrt's "
                   "own ops call the ATen ops instead of their CPU kernels")
  endif()
  set(FXRT_CPU_STUBS_KEY "${key}" CACHE INTERNAL "")
  set(FXRT_CPU_STUBS_DEFINITIONS "${found}" CACHE INTERNAL "")
  set(${out} "${found}" PARENT_SCOPE)
endfunction()
