"""Triton kernels for the paged KV cache, each with a plain-torch reference in ``prefixgate_kernels.reference``."""
