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

Only the interpreter changes, for the whole process (its module's definitions are
replaced): compiled kernels call neither. The ``__index__`` of 3.9 is installed on every
Triton whose interpreter has the names it wraps, 3.9 included, where it sets the
definition 3.9 already has and so changes nothing; ``maxnumf``/``minnumf`` are replaced
only where a probe finds them returning the NaN, so on 3.9 they stay as they are. Where a
name is missing, or the probe fails, a warning names it and what is then not matched.
"""

from __future__ import annotations

import warnings

import numpy as np
import triton.language as tl

_INDEX = "a loop bound computed from a program id (tensor.__index__)"
_NAN = "tl.maximum/tl.minimum of floats beside a NaN (maxnumf/minnumf)"
_warned: set[str] = set()


def _not_matched(why: str, what: str) -> None:
    # Once a message: the install may run again (the tests call it) and says nothing new.
    message = (f"wide_moe_triton: Triton's interpreter {why}; {what} is not matched to "
               f"Triton 3.9 and may fail or differ from a GPU")
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def match_interpreter_to_triton_3_9() -> None:
    try:
        from triton.runtime import interpreter
    except ImportError as e:
        _not_matched(f"cannot be imported ({e})", f"{_INDEX}, nor {_NAN},")
        return
    _index_of_one_element_arrays(interpreter)
    _number_wins_over_nan(interpreter)


def _index_of_one_element_arrays(interpreter) -> None:
    """Wherever the interpreter patches the language for a launch, install 3.9's
    ``__index__`` after its own (and restore it with the rest)."""
    original = getattr(interpreter, "_patch_lang_tensor", None)
    for name, present in (("_patch_lang_tensor", original is not None),
                          ("_LangPatchScope", hasattr(interpreter, "_LangPatchScope"))):
        if not present:
            _not_matched(f"has no {name}", _INDEX)
            return
    if getattr(original, "squeezes_index", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.squeezes_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def _number_wins_over_nan(interpreter) -> None:
    """``maxnumf``/``minnumf`` as ``np.fmax``/``np.fmin`` (IEEE maxNum/minNum)."""
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None:
        _not_matched("has no InterpreterBuilder", _NAN)
        return
    for name in ("create_maxnumf", "create_minnumf", "binary_op"):
        if not hasattr(builder, name):
            _not_matched(f"has no InterpreterBuilder.{name}", _NAN)
            return
    nan, one = np.array([np.nan], np.float32), np.array([1.0], np.float32)

    def keeps_number(name, numpy_fn) -> bool | None:
        """Whether the definition itself keeps the number, so that a Triton that already
        does is left untouched; None where it cannot be asked."""
        try:
            handle = interpreter.TensorHandle
            got = getattr(builder, name)(builder.__new__(builder),
                                         handle(nan, tl.float32), handle(one, tl.float32))
            return bool(np.array_equal(got.data, numpy_fn(nan, one), equal_nan=True))
        except Exception as e:  # the probe's own failure, not a verdict on the definition
            _not_matched(f"could not be probed ({name}: {type(e).__name__}: {e})", _NAN)
            return None

    for name, numpy_fn in (("create_maxnumf", np.fmax), ("create_minnumf", np.fmin)):
        if keeps_number(name, numpy_fn) is False:
            setattr(builder, name, lambda self, lhs, rhs, fn=numpy_fn:
                    self.binary_op(lhs, rhs, fn))
