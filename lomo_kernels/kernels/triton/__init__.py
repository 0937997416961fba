"""Triton kernels and their launchers."""
