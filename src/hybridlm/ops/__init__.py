"""Tensor functions and their C kernels. The package itself imports nothing: the command line reads
the weight quantizations it offers without importing torch."""

# Weight-only quantizations of linear layers (`ops.quant`), as `--quantize` names them.
QUANTIZATIONS = ("int8", "int4")
