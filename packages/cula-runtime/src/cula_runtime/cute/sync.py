"""Synchronisation between the CTAs of one launch through global memory, for CuTeDSL kernels: an atomic ticket, a
flag published with release semantics and read with acquire semantics at GPU scope, a GPU-scope fence and a short
sleep for spin loops.

Each is one PTX instruction written inline (``llvm.inline_asm``): the same text on sm_90a, sm_100a and sm_103a and
on every CuTeDSL version cula-runtime admits (the DSL's own wrappers of these operations differ between them). The
addresses are 32-bit words in global memory, given as the Int64 of a pointer (``tensor.iterator.toint()`` plus a
byte offset: :func:`word_address`).

The pattern they serve (a producer CTA hands data to a consumer CTA of the same launch): every producer thread
stores its part of the data, runs :func:`fence_gpu`, the CTA synchronises, one thread :func:`store_release` the
flag; one consumer thread spins on :func:`load_acquire` until the flag is set, the CTA synchronises, every
consumer thread runs its own :func:`load_acquire` of the flag (its loads after it then see the producer's data,
whatever its L1 holds) and reads the data. A consumer may wait only for a producer that has started and never
waits itself before publishing: the producer's work is taken in ticket order (:func:`atomic_add`), so the launch
cannot deadlock whatever the order the hardware schedules the CTAs in. A spin loop still bounds its polls and
:func:`trap` past them (a launch error, not a hang, should a flag never come).
"""

from __future__ import annotations

from .compile_cache import missing_cutedsl

try:
    from cutlass import Int32, Int64
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op
except ImportError as exc:
    raise missing_cutedsl(exc) from exc

__all__ = ["atomic_add", "fence_gpu", "load_acquire", "nanosleep", "store_release", "trap", "word_address"]


def word_address(base: Int64, index: Int32) -> Int64:
    """The address of 32-bit word ``index`` of a buffer at ``base`` (an Int64 from ``iterator.toint()``)."""
    return base + Int64(index) * Int64(4)


@dsl_user_op
def atomic_add(address: Int64, value: Int32, *, loc=None, ip=None) -> Int32:
    """``atom.relaxed.gpu.global.add.s32``: adds ``value`` to the word at ``address``; returns the old value."""
    return Int32(llvm.inline_asm(
        T.i32(), [Int64(address).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)],
        "atom.relaxed.gpu.global.add.s32 $0, [$1], $2;", "=r,l,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def load_acquire(address: Int64, *, loc=None, ip=None) -> Int32:
    """``ld.acquire.gpu.global.b32``: the word at ``address``; later loads of this thread see what the thread that
    released it had made visible."""
    return Int32(llvm.inline_asm(
        T.i32(), [Int64(address).ir_value(loc=loc, ip=ip)],
        "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def store_release(address: Int64, value: Int32, *, loc=None, ip=None) -> None:
    """``st.release.gpu.global.b32``: ``value`` into the word at ``address``, after every earlier memory operation
    of this thread (and, with :func:`fence_gpu` and a CTA barrier before it, of its CTA)."""
    llvm.inline_asm(
        None, [Int64(address).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)],
        "st.release.gpu.global.b32 [$0], $1;", "l,r,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def fence_gpu(*, loc=None, ip=None) -> None:
    """``fence.acq_rel.gpu``: this thread's earlier stores are ordered before its later ones at GPU scope."""
    llvm.inline_asm(None, [], "fence.acq_rel.gpu;", "~{memory}", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def nanosleep(nanoseconds: int, *, loc=None, ip=None) -> None:
    """``nanosleep.u32``: a pause of up to ``nanoseconds`` (a constant) between polls of a flag."""
    llvm.inline_asm(None, [], f"nanosleep.u32 {int(nanoseconds)};", "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    """``trap``: ends the launch with an error (the host sees ``cudaErrorLaunchFailure``): what a spin loop does when
    a flag it waits for is never set, rather than hang."""
    llvm.inline_asm(None, [], "trap;", "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
