"""One stage a file: each holds its ``@triton.jit`` body, its launch wrapper and its
tuning key (``KERNEL``, ``DEFAULT``, ``SPACE``, ``shape_key``); the routed experts, the
largest stage, are a package of one concern a module (``experts/``). ``bits.py`` holds the
FP32/BF16 bit conversions that several stages share, ``situ.py`` the activation that the
routed and the shared experts share, ``pdl.py`` the programmatic dependent launch from
the experts' down kernel to finalize. The front GEMM (``front.py``) also carries every
other dense linear (the shared expert's, ``shared.py``; the tail's up-projection,
``tail.py``), each under its own tuning name."""
