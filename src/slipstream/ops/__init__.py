"""Custom fused operators (torch.library custom ops with reference and Triton kernels)."""
