# find_package(fxrt CONFIG) with fxrt_DIR=<fxrt>/csrc/cmake: builds fxrt::runtime from source
# as part of the caller's project (it needs the caller's libtorch, found with find_package(Torch)).
if(NOT TARGET fxrt::runtime)
  add_subdirectory(${CMAKE_CURRENT_LIST_DIR}/.. ${CMAKE_BINARY_DIR}/fxrt_runtime)
endif()
set(fxrt_FOUND TRUE)
