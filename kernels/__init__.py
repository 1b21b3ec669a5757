"""Triton kernels for the paged KV cache, each with a plain-torch reference in ``kernels.reference``."""
