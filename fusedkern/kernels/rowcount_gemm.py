"""Row-count GEMMs: the chunked strategy's three GEMMs on only the first n rows of a chunk, n a device
scalar the kernels read themselves — no host synchronization (cuBLAS needs n on the host: a read that
stalls the stream, or the whole chunk's work, ignored rows included). The caller compacts a chunk's
valid tokens to the front of its buffers:

    logits_rows(x, w, b, count, out)          out[:n] = x[:n] @ wᵀ (+ b)     x [C, H], w [V, H], out [C, V]
    dx_rows(g, w, count, out)                 out[:n] = g[:n] @ w            g [C, V], w [V, H], out [C, H]
    dw_rows(g, x, count, out, accumulate)     out (+)= g[:n]ᵀ @ x[:n]        g [C, V], x [C, H], out [V, H]

n = clamp(count, 0, C), count one int32/int64 element on the inputs' device. Products accumulate in fp32
and round once to the output's dtype. `logits_rows` and `dx_rows` never write out[n:] (zeroing would cost
the work this module skips) and never read the inputs' rows ≥ n (they may hold NaN). `dw_rows` sums over
t < n: accumulate=False writes all of out (zeros when n = 0); accumulate=True adds into out, fp32 (the
chunked strategy's accumulator) or the inputs' dtype, and leaves it untouched when n = 0.

Kernels: persistent (one program per SM walks the tiles the valid rows need, so a short chunk costs
proportionally less), grouped tile order, autotuned (≤ 4 configs, keyed on the buffer shapes) over the
building blocks of `gemm_tiles`: TMA descriptors whose token extent is n (sm_90+, aligned 16-bit
operands; dW's β = 1 into fp32 a TMA reduce-add in L2) or masked pointer loads (everything else, and the
interpreter). `impl="tma"` / `"pointer"` force a path. dX has few tiles (H / 256 per row block), so
`dx_rows` launches the tuned kernel and a half-width partner and the one that needs fewer whole waves
for this n does the work (`_narrow_wins`).

Trade-off: it skips the ignored rows without a sync, but the tiles' epilogue does not overlap the next
tile's loads (Triton 3.6's warp-specialized form of these kernels returned NaN for dW: docs/design.md,
"Tried and retired") and fixed tiles leave part of a last wave idle. So at n = C they run at about cuBLAS's
speed on all rows, dW into fp32 a little behind; at n well below C much faster than cuBLAS on all rows of the
chunk, but behind cuBLAS on exactly n rows (`scripts/bench_rowcount_gemm.py`; the table: docs/design.md,
"The row-count GEMMs against cuBLAS").

Size (> 400 lines): three kernels and their launchers, validation and autotune setup, sharing one set of
configs; the device building blocks are in `gemm_tiles`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedkern._runtime import autotune_configs, interpreting, sm_count
from fusedkern.kernels.dot import dot_precision
from fusedkern.kernels.gemm_tiles import (LOAD_ADD_STORE, REDUCE_ADD, STORE, check_count, epilogue,
                                          launch_persistent, linear_tile, operand, product_tile, tma_eligible,
                                          use_tma, valid_rows)

__all__ = ["logits_rows", "dx_rows", "dw_rows", "tma_eligible"]


# ----------------------------------------------------------------------------------------------
# configs


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int, group: int = 8, slices: int = 1) -> triton.Config:
    kwargs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group, "EPI_SLICES": slices}
    return triton.Config(kwargs, num_warps=warps, num_stages=stages)


def _configs(kernel: str, fp32: bool) -> list:
    """Autotune candidates (≤ 4 each: the benchmark must tune within its time limit). Shared memory
    on sm_90 (≤ 227 KiB): stages × (BLOCK_M + BLOCK_N) × BLOCK_K × 2 B for the operand pipeline plus
    one epilogue slice, BLOCK_M × BLOCK_N / EPI_SLICES × the output's element size (TMA path)."""
    if fp32:  # ieee fp32 dots run on the FMA units: small tiles, or the operands spill
        return [_cfg(64, 64, 32, 4, 3), _cfg(64, 128, 32, 8, 2)]
    if kernel == "dw":
        # fp32 output tiles (the accumulator): at 128 × 256 × 64 and 3 stages (147 KB of operand
        # pipeline), half slices (64 KB) fit 227 KiB for a store or reduce-add but not for the
        # 16-bit β = 1 path's load + store (two staging buffers): quarter slices first
        return [_cfg(128, 256, 64, 8, 3, slices=4), _cfg(128, 256, 64, 8, 3, group=16, slices=4),
                _cfg(128, 128, 64, 8, 4, slices=2), _cfg(128, 128, 64, 8, 4, group=16, slices=4)]
    return [_cfg(128, 256, 64, 8, 3), _cfg(128, 256, 64, 8, 4, slices=4),
            _cfg(128, 128, 64, 8, 4), _cfg(128, 256, 64, 8, 3, group=16)]


# The interpreter runs only the first config: a small one, so that the tiny test shapes span several
# tiles in every dimension (masked tails, several tiles per program of the persistent loop), with a
# sliced epilogue.
_INTERP_CONFIG = _cfg(16, 32, 16, 4, 1, group=2, slices=2)


def _config_list(kernel: str, fp32: bool) -> list:
    return autotune_configs([_INTERP_CONFIG] if interpreting() else _configs(kernel, fp32))


#: Compiled once whatever the token extent: C (a chunk's rows; the last chunk's, any count) is a loop bound and a
#: mask, never a stride, so Triton's specialization on C % 16 would only compile a second variant; the count is a
#: slice of a per-chunk vector, 16-byte aligned or not by its chunk's index.
ANY_EXTENT = dict(do_not_specialize=["C"], do_not_specialize_on_alignment=["count_ptr"])


# ----------------------------------------------------------------------------------------------
# (a) logits: Z[:n] = X[:n] @ Wᵀ (+ b)


@triton.jit(**ANY_EXTENT)
def _logits_kernel(
    x_ptr,  # (C, H) input dtype
    w_ptr,  # (V, H)
    b_ptr,  # (V,) bias (HAS_BIAS)
    z_ptr,  # (C, V) output; rows ≥ n untouched
    count_ptr,  # (1,) int32/int64 valid rows
    C, V, H,
    stride_xc, stride_xh, stride_wv, stride_wh, stride_b, stride_zc, stride_zv,
    HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPI_SLICES: tl.constexpr,
):
    n = valid_rows(count_ptr, C)
    num_pid_m = tl.cdiv(n, BLOCK_M)
    num_pid_n = tl.cdiv(V, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    # token extent n: the TMA unit zero-fills rows ≥ n (never read from memory) and clips stores
    # there. max(n, 1): a descriptor's extents must be positive (with n = 0 no tile runs anyway).
    n_desc = tl.maximum(n, 1)
    x = operand(x_ptr, n_desc, H, stride_xc, BLOCK_M, BLOCK_K, USE_TMA)
    w = operand(w_ptr, V, H, stride_wv, BLOCK_N, BLOCK_K, USE_TMA)
    z = operand(z_ptr, n_desc, V, stride_zc, BLOCK_M, BLOCK_N // EPI_SLICES, USE_TMA)
    for tile_id in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0),
                            flatten=USE_TMA):
        off_m, off_n, offs_m, offs_n, mask_m, mask_n, acc = linear_tile(
            x, w, b_ptr, tile_id, num_pid_m, num_pid_n, n, V, H, stride_xc, stride_xh, stride_wv, stride_wh, stride_b,
            HAS_BIAS, USE_TMA, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
        epilogue(z, acc, off_m, off_n, offs_m, offs_n, mask_m, mask_n, stride_zc, stride_zv, 0, USE_TMA,
                 BLOCK_M, BLOCK_N, EPI_SLICES)


# ----------------------------------------------------------------------------------------------
# (b) dX: DX[:n] = G[:n] @ W


#: time of a (BLOCK_M, BLOCK_N / 2) tile relative to a (BLOCK_M, BLOCK_N) one, in percent: half the work at
#: a slightly lower FLOP rate than the wide tiles' (calibrated with scripts/bench_rowcount_gemm.py --sweep:
#: docs/design.md, "The row-count GEMMs against cuBLAS"), rounded up so that near-ties stay wide
_NARROW_COST_PCT = tl.constexpr(54)


@triton.jit
def _narrow_wins(n, C, H, NUM_SMS, BLOCK_M: tl.constexpr, WIDE_N: tl.constexpr):
    """dX's tile width for n valid rows: whether (BLOCK_M, WIDE_N / 2) tiles finish before
    (BLOCK_M, WIDE_N) ones, counting whole waves of the persistent grid (the grid sizes the host
    launches, recomputed here). dX has few tiles (H / WIDE_N per row block), so the last wave's
    fill matters: at n = 1229, 128 × 256 tiles make 160 tiles for 132 SMs (2 waves, the second
    one fifth full), 128 × 128 tiles 320 (3 waves of half the work each)."""
    m_tiles = tl.cdiv(n, BLOCK_M)
    m_max = tl.cdiv(C, BLOCK_M)
    p_wide = tl.minimum(NUM_SMS, m_max * tl.cdiv(H, WIDE_N))
    p_narrow = tl.minimum(NUM_SMS, m_max * tl.cdiv(H, WIDE_N // 2))
    waves_wide = tl.cdiv(m_tiles * tl.cdiv(H, WIDE_N), p_wide)
    waves_narrow = tl.cdiv(m_tiles * tl.cdiv(H, WIDE_N // 2), p_narrow)
    return waves_narrow * _NARROW_COST_PCT < waves_wide * 100


@triton.jit(**ANY_EXTENT)
def _dx_kernel(
    g_ptr,  # (C, V)
    w_ptr,  # (V, H)
    dx_ptr,  # (C, H) output; rows ≥ n untouched
    count_ptr,
    C, V, H,
    stride_gc, stride_gv, stride_wv, stride_wh, stride_dxc, stride_dxh,
    NUM_SMS,  # the SM count the host sizes both grids of a wide/narrow pair with (PICK > 0)
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PICK: tl.constexpr,  # 0: always run; 1: the wide kernel of a pair; 2: its narrow partner
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPI_SLICES: tl.constexpr,
):
    n = valid_rows(count_ptr, C)
    num_pid_m = tl.cdiv(n, BLOCK_M)
    num_pid_n = tl.cdiv(H, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    # a wide/narrow pair: both kernels read n and agree which of them does the work; the other one's
    # programs exit at once (one launch of empty programs, still no host sync)
    if PICK == 1:
        num_tiles = tl.where(_narrow_wins(n, C, H, NUM_SMS, BLOCK_M, BLOCK_N), 0, num_tiles)
    elif PICK == 2:
        num_tiles = tl.where(_narrow_wins(n, C, H, NUM_SMS, BLOCK_M, 2 * BLOCK_N), num_tiles, 0)
    n_desc = tl.maximum(n, 1)
    g = operand(g_ptr, n_desc, V, stride_gc, BLOCK_M, BLOCK_K, USE_TMA)
    w = operand(w_ptr, V, H, stride_wv, BLOCK_K, BLOCK_N, USE_TMA)
    dx = operand(dx_ptr, n_desc, H, stride_dxc, BLOCK_M, BLOCK_N // EPI_SLICES, USE_TMA)
    for tile_id in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0),
                            flatten=USE_TMA):
        off_m, off_n, offs_m, offs_n, mask_m, mask_n, acc = product_tile(
            g, w, tile_id, num_pid_m, num_pid_n, n, H, V, stride_gc, stride_gv, stride_wv, stride_wh, False, True,
            USE_TMA, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
        epilogue(dx, acc, off_m, off_n, offs_m, offs_n, mask_m, mask_n, stride_dxc, stride_dxh, 0, USE_TMA,
                 BLOCK_M, BLOCK_N, EPI_SLICES)


# ----------------------------------------------------------------------------------------------
# (c) dW: DW (+)= G[:n]ᵀ @ X[:n]


@triton.jit(**ANY_EXTENT)
def _dw_kernel(
    g_ptr,  # (C, V)
    x_ptr,  # (C, H)
    dw_ptr,  # (V, H) output, fp32 or the inputs' dtype
    count_ptr,
    C, V, H,
    stride_gc, stride_gv, stride_xc, stride_xh, stride_dwv, stride_dwh,
    ACCUMULATE: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EPI_MODE: tl.constexpr,  # 0 store (β = 0), 1 load-add-store, 2 reduce-add (β = 1; TMA path)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPI_SLICES: tl.constexpr,
):
    # M = V (vocabulary rows of dW), N = H, K = the n valid tokens
    n = valid_rows(count_ptr, C)
    num_pid_m = tl.cdiv(V, BLOCK_M)
    num_pid_n = tl.cdiv(H, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    if ACCUMULATE:
        num_tiles = tl.where(n == 0, 0, num_tiles)  # adding an empty sum: touch nothing
    n_desc = tl.maximum(n, 1)
    g = operand(g_ptr, n_desc, V, stride_gc, BLOCK_K, BLOCK_M, USE_TMA)
    x = operand(x_ptr, n_desc, H, stride_xc, BLOCK_K, BLOCK_N, USE_TMA)
    dw = operand(dw_ptr, V, H, stride_dwv, BLOCK_M, BLOCK_N // EPI_SLICES, USE_TMA)
    for tile_id in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0),
                            flatten=USE_TMA):
        off_m, off_n, offs_m, offs_n, mask_m, mask_n, acc = product_tile(
            g, x, tile_id, num_pid_m, num_pid_n, V, H, n, stride_gv, stride_gc, stride_xc, stride_xh, True, True,
            USE_TMA, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
        epilogue(dw, acc, off_m, off_n, offs_m, offs_n, mask_m, mask_n, stride_dwv, stride_dwh, EPI_MODE, USE_TMA,
                 BLOCK_M, BLOCK_N, EPI_SLICES)


# ----------------------------------------------------------------------------------------------
# autotuned kernels (one per operand width: fp32 gets FMA-friendly tiles). The autotune keys hold
# the buffer shapes, never the count: it is not known on the host, and one tuned config serves all.

def _tuned(kernel, name: str, fp32: bool, key: list, restore: list):
    return triton.autotune(configs=_config_list(name, fp32), key=key, restore_value=restore)(kernel)


_LOGITS = {fp32: _tuned(_logits_kernel, "logits", fp32, ["C", "V", "H", "HAS_BIAS", "USE_TMA"], [])
           for fp32 in (False, True)}
_DX = {fp32: _tuned(_dx_kernel, "dx", fp32, ["C", "V", "H", "USE_TMA"], []) for fp32 in (False, True)}
# β = 1: the autotuner runs every candidate on the real output, so it restores it after each run
_DW = {(fp32, acc): _tuned(_dw_kernel, "dw", fp32, ["C", "V", "H", "USE_TMA"], ["dw_ptr"] if acc else [])
       for fp32 in (False, True) for acc in (False, True)}


# ----------------------------------------------------------------------------------------------
# host side

#: the config the autotuner chose, per kernel and problem class (`_launch_tuned`)
_CHOSEN: dict = {}


def token_class(C: int) -> int:
    """The token extents one autotuned choice stands for: C rounded up to a power of two, at least one row block of
    the candidates (128). Which tile wins follows the extent's scale, not its exact value; tuned per exact C, a loop
    whose micro-batches score a different count each would run every candidate config again at each new last-chunk
    length."""
    return max(128, triton.next_power_of_2(C))


def problem_class(tuned, sizes: tuple, args: tuple, flags: dict) -> tuple:
    """What a tuned choice is kept under: the kernel, the token class of sizes (C, V, H), V and H, the flags and the
    operands' dtypes."""
    C, V, H = sizes
    dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
    return (tuned, token_class(C), V, H, tuple(sorted(flags.items())), dtypes, args[0].device)


def _launch_tuned(tuned, sizes: tuple, rows: int, cols: int, dev, args: tuple, flags: dict, config) -> None:
    """`launch_persistent` with the autotuner's choice kept per `problem_class`: the first call of a class autotunes
    (at its own extent), the later ones launch that config."""
    if config is None:
        key = problem_class(tuned, sizes, args, flags)
        config = _CHOSEN.get(key)
        if config is None:
            launch_persistent(tuned, rows, cols, dev, args, flags, None)
            _CHOSEN[key] = getattr(tuned, "best_config", None) or tuned.configs[0]
            return
    launch_persistent(tuned, rows, cols, dev, args, flags, config)


_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def _check_2d(name: str, t: torch.Tensor, shape: tuple, device: torch.device, dtypes=_FLOAT) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != 2 or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be one of {dtypes}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must live on {device}, got {t.device}")


def _require_2d(**operands) -> None:
    """Each operand, passed as name=(tensor, "[dims]"), must be a 2-D tensor (checked before its sizes are read)."""
    for name, (t, dims) in operands.items():
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor {dims}")


def _check_gemm(count: torch.Tensor, a_name: str, a: torch.Tensor, a_shape: tuple, b_name: str, b: torch.Tensor,
                b_shape: tuple, out: torch.Tensor, out_shape: tuple) -> torch.Tensor:
    """Operands of one GEMM on a's device with their expected shapes: a fp32/fp16/bf16, b in a's dtype,
    out in a's dtype or fp32. Returns count as a one-element tensor."""
    dev = a.device
    _check_2d(a_name, a, a_shape, dev)
    _check_2d(b_name, b, b_shape, dev, (a.dtype,))
    _check_2d("out", out, out_shape, dev, (a.dtype, torch.float32))
    return check_count(count, dev)


def logits_rows(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, count: torch.Tensor, out: torch.Tensor,
                *, impl: str = "auto", config: triton.Config | None = None) -> torch.Tensor:
    """out[:n] = x[:n] @ wᵀ (+ b) with n = clamp(count, 0, C) read on the device; out[n:] is not written.

    x: [C, H] fp32/fp16/bf16 · w: [V, H], x's dtype · b: [V] (any float dtype) or None ·
    count: one-element int32/int64 tensor on x's device · out: [C, V], x's dtype or fp32 (fp32
    accumulation, one rounding) · impl: 'auto' | 'tma' | 'pointer' (module docstring) · config:
    a `triton.Config` to run instead of autotuning. Returns out."""
    _require_2d(x=(x, "[C, H]"), w=(w, "[V, H]"))
    (C, H), V, dev = x.shape, w.shape[0], x.device
    count = _check_gemm(count, "x", x, (C, H), "w", w, (V, H), out, (C, V))
    if b is not None:
        if not isinstance(b, torch.Tensor) or b.dim() != 1 or b.shape[0] != V or b.device != dev:
            raise ValueError(f"b must be a [{V}] tensor on {dev}")
        if not b.is_floating_point():
            raise TypeError(f"b must be a float tensor, got {b.dtype}")
    if C == 0 or V == 0:
        return out
    fp32 = x.dtype == torch.float32
    args = (x, w, b if b is not None else x, out, count, C, V, H,
            x.stride(0), x.stride(1), w.stride(0), w.stride(1), b.stride(0) if b is not None else 0,
            out.stride(0), out.stride(1))
    flags = dict(HAS_BIAS=b is not None, USE_TMA=H > 0 and use_tma(impl, (x, w), (out,)),
                 DOT_PRECISION=dot_precision(x.dtype))
    _launch_tuned(_LOGITS[fp32], (C, V, H), C, V, dev, args, flags, config)
    return out


def _narrow_partner(config: triton.Config) -> triton.Config | None:
    """The (BLOCK_M, BLOCK_N / 2) partner of a wide dX config, or None when BLOCK_N / 2 would be
    narrower than a useful tile (128 on the GPU; 16 in the interpreter, so the tests run pairs)."""
    kw = config.kwargs
    if kw["BLOCK_N"] // 2 < (16 if interpreting() else 128):
        return None
    return _cfg(kw["BLOCK_M"], kw["BLOCK_N"] // 2, kw["BLOCK_K"], config.num_warps,
                min(config.num_stages + 1, 4) if not interpreting() else 1, group=kw["GROUP_M"], slices=1)


def dx_rows(g: torch.Tensor, w: torch.Tensor, count: torch.Tensor, out: torch.Tensor, *,
            impl: str = "auto", config: triton.Config | None = None) -> torch.Tensor:
    """out[:n] = g[:n] @ w with n = clamp(count, 0, C) read on the device; out[n:] is not written.

    g: [C, V] fp32/fp16/bf16 · w: [V, H], g's dtype · count: one-element int32/int64 tensor on g's
    device · out: [C, H], g's dtype or fp32 · impl, config: as `logits_rows`. Returns out.

    Tile width follows n without a sync: the first call of a `problem_class` autotunes and runs the
    tuned kernel alone; later calls launch the tuned (wide) kernel and its half-width partner, and
    the one that finishes in fewer whole waves for this n does the work (`_narrow_wins`). With an
    explicit `config` only that kernel runs."""
    _require_2d(g=(g, "[C, V]"), w=(w, "[V, H]"))
    (C, V), H, dev = g.shape, w.shape[1], g.device
    count = _check_gemm(count, "g", g, (C, V), "w", w, (V, H), out, (C, H))
    if C == 0 or H == 0:
        return out
    if V == 0:  # an empty sum: the pointer kernel writes zeros into the valid rows
        impl = "pointer"
    fp32 = g.dtype == torch.float32
    sms = sm_count(dev)
    args = (g, w, out, count, C, V, H,
            g.stride(0), g.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1), sms)
    tma = use_tma(impl, (g, w), (out,))
    flags = dict(USE_TMA=tma, DOT_PRECISION=dot_precision(g.dtype))
    tuned = _DX[fp32]
    if config is not None:
        launch_persistent(tuned, C, H, dev, args, dict(flags, PICK=0), config)
        return out
    key = problem_class(tuned, (C, V, H), args, flags)
    chosen = _CHOSEN.get(key)
    if chosen is None:  # first call: autotune (at this call's n) and run the tuned kernel alone
        launch_persistent(tuned, C, H, dev, args, dict(flags, PICK=0), None)
        _CHOSEN[key] = getattr(tuned, "best_config", None) or tuned.configs[0]
        return out
    partner = _narrow_partner(chosen)
    if partner is None:
        launch_persistent(tuned, C, H, dev, args, dict(flags, PICK=0), chosen)
    else:
        launch_persistent(tuned, C, H, dev, args, dict(flags, PICK=1), chosen)
        launch_persistent(tuned, C, H, dev, args, dict(flags, PICK=2), partner)
    return out


def dw_rows(g: torch.Tensor, x: torch.Tensor, count: torch.Tensor, out: torch.Tensor, accumulate: bool, *,
            impl: str = "auto", config: triton.Config | None = None) -> torch.Tensor:
    """out (+)= g[:n]ᵀ @ x[:n] with n = clamp(count, 0, C) read on the device.

    g: [C, V] fp32/fp16/bf16 · x: [C, H], g's dtype · count: one-element int32/int64 tensor on g's
    device · out: [V, H], fp32 or g's dtype · accumulate: False writes every element of out (zeros
    when n = 0); True adds to it (β = 1, the sum formed in fp32 and rounded once to out's dtype;
    untouched when n = 0) · impl, config: as `dx_rows`. Returns out."""
    _require_2d(g=(g, "[C, V]"), x=(x, "[C, H]"))
    (C, V), H, dev = g.shape, x.shape[1], g.device
    count = _check_gemm(count, "g", g, (C, V), "x", x, (C, H), out, (V, H))
    if V == 0 or H == 0:
        return out
    accumulate = bool(accumulate)
    if C == 0:  # n = 0 for certain, known on the host
        if not accumulate:
            out.zero_()
        return out
    fp32 = g.dtype == torch.float32
    args = (g, x, out, count, C, V, H,
            g.stride(0), g.stride(1), x.stride(0), x.stride(1), out.stride(0), out.stride(1))
    if not accumulate:
        mode = STORE
    elif out.dtype == torch.float32 and not interpreting():
        mode = REDUCE_ADD  # the interpreter has no reduce-add
    else:
        mode = LOAD_ADD_STORE  # a 16-bit sum is formed in fp32 and rounded once
    flags = dict(ACCUMULATE=accumulate, USE_TMA=use_tma(impl, (g, x), (out,)), DOT_PRECISION=dot_precision(g.dtype),
                 EPI_MODE=mode)
    _launch_tuned(_DW[(fp32, accumulate)], (C, V, H), V, H, dev, args, flags, config)
    return out
