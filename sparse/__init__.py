"""N:M bitmask sparse weights: the format, the Triton kernels and the SparseLinear layer."""
from sparse.format import is_unstructured, pack, parse_pattern, unpack, validate
from sparse.linear import SparseLinear, sparse_matmul, swap_linears_for_state_dict, swap_to_sparse

__all__ = ["parse_pattern", "is_unstructured", "pack", "unpack", "validate", "sparse_matmul",
           "SparseLinear", "swap_to_sparse", "swap_linears_for_state_dict"]
