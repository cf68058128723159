"""Tensor parallelism: one-sided puts (put.py) and the collective matmuls built on them
(matmul.py). The public names are in jaxcomm/tp.py."""
