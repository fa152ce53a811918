"""MatMulNBits settings the int4 build and the engine manifest share (no heavy imports: the
manifest is read by every command)."""

HEAD_SCHEME = "Q8_0"  # the LM head's blocks, at accuracy level 4
INT8_ACTIVATIONS = 4  # MatMulNBits accuracy_level: activations quantized to int8 per block
FP32_COMPUTE = 0  # MatMulNBits accuracy_level: fp32 compute on the dequantized weights
ACCURACY_LEVELS = (INT8_ACTIVATIONS, FP32_COMPUTE)
DEFAULT_ACCURACY_LEVEL = FP32_COMPUTE  # the only level whose speculative output equals target-only's
