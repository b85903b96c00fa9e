"""Intrinsics for the numba kernels: an exact fused multiply-add (one rounding, IEEE 754
``fma``), float32 views of memory given by address (the received frames), and bitcasts
between a float32 and its bits.

torch's CPU kernels are compiled with FMA contraction, so matching them bit for bit
needs the fused operation explicitly where they fuse, and plain ``a * b + c`` where
they do not.
"""

from __future__ import annotations

from numba import types
from numba.extending import intrinsic


@intrinsic
def fma32(typingctx, a, b, c):  # noqa: ARG001 - numba intrinsic signature
    """``a * b + c`` for float32 with a single rounding (LLVM ``llvm.fma.f32``)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):  # noqa: ARG001
        return builder.fma(args[0], args[1], args[2])

    return sig, codegen


@intrinsic
def f32_at(typingctx, addr):  # noqa: ARG001 - numba intrinsic signature
    """A ``float32*`` at integer address ``addr`` (wrap with ``numba.carray``)."""
    ptr = types.CPointer(types.float32)
    sig = ptr(types.int64)

    def codegen(context, builder, signature, args):  # noqa: ARG001
        return builder.inttoptr(args[0], context.get_value_type(ptr))

    return sig, codegen


@intrinsic
def f32_bits(typingctx, x):  # noqa: ARG001 - numba intrinsic signature
    """The bits of a float32 as a uint32 (a bitcast)."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):  # noqa: ARG001
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return sig, codegen


@intrinsic
def bits_f32(typingctx, b):  # noqa: ARG001 - numba intrinsic signature
    """The float32 whose bits are the uint32 ``b`` (a bitcast)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):  # noqa: ARG001
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return sig, codegen
