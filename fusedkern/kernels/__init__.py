"""Triton kernels. Import `fusedkern._runtime` first: it picks GPU or interpreter."""
