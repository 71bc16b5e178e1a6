// Qualifiers shared by headers that the host compiler, the CPU kernels and nvcc all read.
#pragma once

#if defined(__CUDACC__)
#define FLASHCORE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FLASHCORE_HOST_DEVICE inline
#endif
