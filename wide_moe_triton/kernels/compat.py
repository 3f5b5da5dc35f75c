"""Triton's interpreter as Triton 3.9 defines it, on the older Tritons that pyproject
admits (3.6 onwards), so that the kernels run in the interpreter of each alike.

Two definitions of Triton 3.6's interpreter differ from 3.9's, and the kernels meet both:

- a kernel's scalar (a program id, an int argument, anything computed from them) is a
  one-element numpy array, and 3.6 defines ``tensor.__index__`` as ``int(data)``, which
  numpy 2 refuses for an array of one dimension: ``for kb in range(k_lo, k_hi)`` fails
  whenever a bound is not a constexpr. 3.9 takes ``int(data.squeeze())``.
- ``tl.maximum``/``tl.minimum`` of floats (``maxnumf``/``minnumf``, what a GPU computes
  by default) return the number when the other operand is NaN; 3.6's interpreter
  computes them with ``np.maximum``/``np.minimum``, which return the NaN (the route
  counts a NaN bound as -inf through exactly that rule). 3.9 uses ``np.fmax``/``np.fmin``.

Only the interpreter changes: compiled kernels call neither. On 3.9 both are already so
and nothing is replaced; a Triton whose interpreter lacks these names is left as it is.
"""

from __future__ import annotations

import numpy as np
import triton.language as tl


def match_interpreter_to_triton_3_9() -> None:
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    _index_of_one_element_arrays(interpreter)
    _number_wins_over_nan(interpreter)


def _index_of_one_element_arrays(interpreter) -> None:
    """Wherever the interpreter patches the language for a launch, install 3.9's
    ``__index__`` after its own (and restore it with the rest)."""
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if (original is None or not hasattr(interpreter, "_LangPatchScope")
            or getattr(original, "squeezes_index", False)):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.squeezes_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def _number_wins_over_nan(interpreter) -> None:
    """``maxnumf``/``minnumf`` as ``np.fmax``/``np.fmin`` (IEEE maxNum/minNum)."""
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not all(hasattr(builder, n) for n in ("create_maxnumf",
                                                                "create_minnumf")):
        return
    nan, one = np.array([np.nan], np.float32), np.array([1.0], np.float32)

    def keeps_number(create, numpy_fn) -> bool:
        # Asked of the definition itself, so a Triton that already keeps the number is
        # left untouched.
        handle = interpreter.TensorHandle
        try:
            got = create(builder.__new__(builder), handle(nan, tl.float32),
                         handle(one, tl.float32))
        except Exception:
            return True
        return bool(np.array_equal(got.data, numpy_fn(nan, one), equal_nan=True))

    for name, numpy_fn in (("create_maxnumf", np.fmax), ("create_minnumf", np.fmin)):
        if not keeps_number(getattr(builder, name), numpy_fn):
            setattr(builder, name, lambda self, lhs, rhs, fn=numpy_fn:
                    self.binary_op(lhs, rhs, fn))
