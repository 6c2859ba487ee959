"""verispec's own compute kernels (see native)."""
