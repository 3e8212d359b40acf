"""The CPU backend: C kernels (the *.c / *.h here, compiled on first use by build.py), their
ctypes launchers, the packed-weight memory helpers, and `backend.CpuBackend` that binds them."""
