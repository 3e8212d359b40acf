"""The Triton backend (CUDA; the CPU only under TRITON_INTERPRET=1): one module per kernel and
`backend.TritonBackend` that binds them. Importing this package does not import triton."""
