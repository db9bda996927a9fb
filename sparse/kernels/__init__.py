"""The Triton kernels of the N:M bitmask format, one kernel a module, each with its launcher and its
candidate configs:

- spmv.py: the SpMV on the CUDA cores (1-16 rows of x), with the decode step's fusions;
- spmm.py: the SpMM on the tensor cores (tl.dot on tiles expanded in registers);
- mma_sp.py: the 2:4 product on the sparse tensor cores (mma.sp);
- unpack.py: expansion to dense (the prefill: expand, then cuBLAS);
- decode_attention.py: flash-decoding attention with RoPE, q/k norms and the KV write inside.

common.py holds what they share (the interpreter switch, the split-K workspace, small
@triton.jit helpers); tuning.py times and races configs. Which kernel runs for which rows and
shape is sparse/linear.py's route table.
"""
