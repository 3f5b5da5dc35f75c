"""One stage a file: each holds its ``@triton.jit`` body, its launch wrapper and its
tuning key (``KERNEL``, ``DEFAULT``, ``SPACE``, ``shape_key``). ``bits.py`` holds the
FP32/BF16 bit conversions that several stages share."""
