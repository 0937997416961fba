"""lomo_kernels."""
