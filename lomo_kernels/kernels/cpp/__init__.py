"""C++ CPU and CUDA C++ kernels (csrc/), built on first use."""
