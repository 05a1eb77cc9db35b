"""lathe.kernels: Triton kernels, each beside its PyTorch reference, and the dispatch
between them (see DESIGN.md). Imports only torch and triton."""
