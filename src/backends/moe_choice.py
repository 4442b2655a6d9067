"""The routed-experts function a built-in backend runs for ``BackendOptions.moe``.

Owns :func:`moe_function`, which both the torch backend's factory (:mod:`backends.plugin`) and
the GGUF backend (:mod:`backends.gguf.backend`) call: the torch reference
(:func:`backends.torch.moe.moe_forward`), the Triton kernels (:mod:`backends.triton_moe`), or a
caller's own function.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import BackendError, InvalidValueError


def moe_function(choice: Any, folders: Sequence[Path]) -> Any:
    """The routed-experts function for the ``moe`` option (see the module docstring)."""
    if callable(choice):
        return choice
    if choice == "torch":
        from backends.torch.moe import moe_forward

        return moe_forward
    if choice == "triton":
        try:
            from backends.triton_moe.launch import TritonMoe
        except ImportError as exc:
            raise BackendError(f"moe='triton' needs the triton package ({exc}); install "
                               "the 'triton' extra") from exc
        return TritonMoe(list(folders))
    raise InvalidValueError("moe", choice, "must be 'torch', 'triton' or a callable")
