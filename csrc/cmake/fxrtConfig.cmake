# find_package(fxrt CONFIG) with fxrt_DIR=<fxrt>/csrc/cmake: builds fxrt::runtime from source
# as part of the caller's project, against the caller's libtorch (found here, in the caller's
# scope, when the caller has not found it: torch's imported targets are visible only in the
# directory that finds them). An installed fxrt has its own config (fxrtInstallConfig.cmake.in).
if(NOT TARGET torch)
  find_package(Torch REQUIRED)
endif()
if(NOT TARGET fxrt::runtime)
  add_subdirectory(${CMAKE_CURRENT_LIST_DIR}/.. ${CMAKE_BINARY_DIR}/fxrt_runtime)
endif()
set(fxrt_FOUND TRUE)
