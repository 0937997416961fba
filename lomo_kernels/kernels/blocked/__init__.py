"""Kernels written as blocked torch operations: any device, no build step."""
