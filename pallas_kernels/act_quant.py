"""FP8 activation quantization fused into its producer: Pallas kernels and their pure-JAX
references.

An FP8 projection (W8A8) takes its input as e4m3 values with one float32 scale per token
(absmax / 448). Computed by XLA after the producer, that quantization is two more passes
over the activations (one for the absmax, one to divide and convert) on top of the
producer's own. Here the producer and the quantization are one kernel, one program per
token: the row is loaded once, kept in registers, reduced to its absmax and stored as
e4m3, so the only traffic is the producer's input and the 1-byte output.

Two producers, those of the FP8 projections' inputs in a LLaMA layer:
- `rms_norm_quant`: RMSNorm (the input of q/k/v and of gate/up);
- `silu_mul_quant`: SiLU(gate) x up (the input of down). With `scales`, gate and up are
  FP8 GEMMs' outputs before their dequantization (a row scale per token, a column scale
  per output channel), applied here: XLA would otherwise give each its own pass in and
  out of memory, as a kernel's input is not fused into it (on the H200, 2 x 117 MB a
  layer at 2,048 tokens).
`quantize_rows` takes an input with no producer kernel (the attention output, o's input)
in one pass.

Both compute in float32 from the producer's inputs to the quantization, with no rounding
to the model dtype in between (as XLA's GPU fusions do, excess precision being allowed by
default); the references are the same functions in XLA.

Pallas' Triton lowering needs power-of-2 shapes: a row is taken in `chunk` columns at a
time (the largest power of 2 dividing its width, at most MAX_CHUNK), unrolled, so a row
of 14,336 is 7 chunks of 2,048. silu_mul_quant's `two_pass` loops over the chunks twice
instead (the absmax, then the values, re-read), holding one chunk rather than the row.
`rows` > 1 gives a program that many rows, one [rows, chunk] tile a piece: more bytes in
flight a program, and silu_mul_quant's column scales loaded once for them all.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0      # the largest finite e4m3fn value
MIN_SCALE = 1e-12    # an all-zero row's scale (no division by 0)
MAX_CHUNK = 2048     # columns per unrolled piece of a row
MAX_CHUNKS = 16      # pieces a row may take (the registers a program holds)


def _scale_of(amax):
    """A row's scale from its absmax (an all-zero row: MIN_SCALE)."""
    return jnp.maximum(amax, MIN_SCALE) / FP8_MAX


def _e4m3(piece, scale, dtype):
    return jnp.clip(piece / scale, -FP8_MAX, FP8_MAX).astype(dtype)


def _quantize_rows(y):
    """y [..., N] f32 -> (e4m3, scale [..., 1] f32): each row's absmax maps to 448."""
    scale = _scale_of(jnp.max(jnp.abs(y), axis=-1, keepdims=True))
    return _e4m3(y, scale, FP8), scale


def rms_norm_quant_reference(x, weight, eps: float):
    """x [T, H], weight [H] -> (e4m3 [T, H], scale [T, 1] f32): RMSNorm (layers/linear.py)
    then per-token quantization (layers/fp8.py), in f32."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return _quantize_rows(weight.astype(jnp.float32) * y)


def quantize_rows_reference(x):
    """x [T, N] -> (e4m3 [T, N], scale [T, 1] f32): per-token quantization alone (an
    input with no producer kernel to fuse into: the attention output, o_proj's input)."""
    return _quantize_rows(x.astype(jnp.float32))


def silu_mul_quant_reference(gate, up, scales=None):
    """gate, up [T, I] -> (e4m3 [T, I], scale [T, 1] f32): SiLU(gate) x up then per-token
    quantization, in f32. scales: None, or (row [T, 1], gate's columns [I], up's [I]) that
    gate and up are multiplied by first."""
    g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
    if scales is not None:
        row, gate_cols, up_cols = (jnp.asarray(x, jnp.float32) for x in scales)
        g, u = g * row * gate_cols, u * row * up_cols
    return _quantize_rows(g * jax.nn.sigmoid(g) * u)


def chunk_of(width: int) -> int | None:
    """The columns a kernel takes at a time for rows of `width` (None: it cannot)."""
    chunk = min(width & -width, MAX_CHUNK)  # the largest power of 2 dividing width
    if chunk < 16 or width // chunk > MAX_CHUNKS:
        return None
    return chunk


def unsupported(width: int) -> str | None:
    """Why the kernels cannot take rows of this width (None when they can)."""
    if chunk_of(width) is None:
        return (f"rows of {width}: the kernels take rows of at most {MAX_CHUNKS} pieces "
                f"of a power of 2 from 16 to {MAX_CHUNK} columns")
    return None


def _spans(width: int, chunk: int) -> list[tuple[int, int]]:
    """A row cut into (start, size) pieces of at most `chunk` columns, each a power of 2
    (14,336 at 4,096: three of 4,096 and one of 2,048)."""
    spans, start = [], 0
    while start < width:
        size = min(chunk, 1 << ((width - start).bit_length() - 1))
        spans.append((start, size))
        start += size
    return spans


def _program_rows(rows: int):
    """Where the program's rows are (`at`): an index (one row: 1-D pieces, scalar scales,
    the kernels as they were before `rows`) or a slice of `rows` ([rows, size] pieces)."""
    if rows == 1:
        return pl.program_id(0)
    return pl.ds(pl.multiple_of(pl.program_id(0) * rows, rows), rows)


def _row_amax(p):
    """A piece's absmax by row: a scalar for a 1-D piece, [rows, 1] for a 2-D one."""
    return jnp.max(jnp.abs(p), axis=-1, keepdims=p.ndim > 1)


def _store_scale(s_ref, at, scale):
    s_ref[at] = scale[:, 0] if scale.ndim else scale


def _store_quantized(pieces, q_ref, s_ref, at, chunk):
    scale = _scale_of(functools.reduce(jnp.maximum, [_row_amax(p) for p in pieces]))
    for (start, size), p in zip(_spans(q_ref.shape[1], chunk), pieces):
        q_ref[at, pl.ds(start, size)] = _e4m3(p, scale, q_ref.dtype)
    _store_scale(s_ref, at, scale)


def _rms_norm_quant_kernel(x_ref, w_ref, q_ref, s_ref, *, chunk, eps, rows):
    at, width = _program_rows(rows), x_ref.shape[1]
    spans = _spans(width, chunk)
    xs = [x_ref[at, pl.ds(*s)].astype(jnp.float32) for s in spans]
    mean_sq = sum(jnp.sum(p * p, axis=-1, keepdims=p.ndim > 1) for p in xs) / width
    inv = jax.lax.rsqrt(mean_sq + eps)
    pieces = [w_ref[pl.ds(*s)].astype(jnp.float32) * (p * inv) for s, p in zip(spans, xs)]
    _store_quantized(pieces, q_ref, s_ref, at, chunk)


def _quantize_rows_kernel(x_ref, q_ref, s_ref, *, chunk, rows):
    at = _program_rows(rows)
    _store_quantized([x_ref[at, pl.ds(*s)].astype(jnp.float32)
                      for s in _spans(x_ref.shape[1], chunk)], q_ref, s_ref, at, chunk)


def _silu_mul_quant_kernel(g_ref, u_ref, *refs, chunk, scaled, two_pass, rows):
    *scale_refs, q_ref, s_ref = refs  # scaled: the row scales [T], gate's and up's [I]
    at = _program_rows(rows)

    def columns(c):  # c: a loop index
        return pl.ds(pl.multiple_of(c * chunk, chunk), chunk)

    def piece(c):  # c: a loop index or a (start, size) span
        cols = pl.ds(*c) if isinstance(c, tuple) else columns(c)
        g = g_ref[at, cols].astype(jnp.float32)
        u = u_ref[at, cols].astype(jnp.float32)
        if scaled:
            rows_ref, g_cols_ref, u_cols_ref = scale_refs
            r = rows_ref[at]
            r = r if rows == 1 else r[:, None]
            g, u = g * (r * g_cols_ref[cols]), u * (r * u_cols_ref[cols])
        return g * jax.nn.sigmoid(g) * u

    if not two_pass:  # the rows held in registers, read once
        _store_quantized([piece(c) for c in _spans(g_ref.shape[1], chunk)], q_ref, s_ref,
                         at, chunk)
        return
    n = g_ref.shape[1] // chunk
    # two loops over the row: its absmax, then the values again (re-read, from L2 where
    # the program's rows still are), so a program holds one piece: more programs per SM
    amax = jax.lax.fori_loop(0, n, lambda c, m: jnp.maximum(m, _row_amax(piece(c))),
                             jnp.zeros((rows, 1) if rows > 1 else (), jnp.float32))
    scale = _scale_of(amax)

    def store(c, carry):
        q_ref[at, columns(c)] = _e4m3(piece(c), scale, q_ref.dtype)
        return carry
    jax.lax.fori_loop(0, n, store, 0)
    _store_scale(s_ref, at, scale)


def _check_rows(tokens: int, rows: int) -> None:
    if rows < 1 or rows & (rows - 1) or tokens % rows:
        raise ValueError(f"rows {rows} a program: a power of 2 dividing the {tokens} tokens")


def _call(kernel, tokens: int, width: int, args, *, rows: int, num_warps: int,
          interpret: bool, name: str):
    _check_rows(tokens, rows)
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        params["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    q, s = pl.pallas_call(
        functools.partial(kernel, rows=rows), grid=(tokens // rows,), name=name,
        interpret=interpret,
        out_shape=(jax.ShapeDtypeStruct((tokens, width), FP8),
                   jax.ShapeDtypeStruct((tokens,), jnp.float32)), **params)(*args)
    return q, s[:, None]


def rms_norm_quant(x, weight, eps: float, *, num_warps: int = 4, rows: int = 1,
                   interpret: bool = False):
    """Fused rms_norm_quant_reference: x [T, H], weight [H] -> (e4m3 [T, H], scale [T, 1]).
    rows: rows a program (a power of 2 dividing T)."""
    if (why := unsupported(x.shape[1])) is not None:
        raise ValueError(why)
    kern = functools.partial(_rms_norm_quant_kernel, chunk=chunk_of(x.shape[1]), eps=eps)
    return _call(kern, x.shape[0], x.shape[1], (x, weight), rows=rows,
                 num_warps=num_warps, interpret=interpret, name="rms_norm_quant")


def quantize_rows(x, *, num_warps: int = 8, rows: int = 1, interpret: bool = False):
    """quantize_rows_reference in one pass: x [T, N] -> (e4m3 [T, N], scale [T, 1]). XLA
    takes two (the row absmax, then the divide and convert), each reading x: at 2,048 x
    4,096 on the H100 this kernel took half XLA's time (bench/results/log/fp8.md §93)."""
    if (why := unsupported(x.shape[1])) is not None:
        raise ValueError(why)
    kern = functools.partial(_quantize_rows_kernel, chunk=chunk_of(x.shape[1]))
    return _call(kern, x.shape[0], x.shape[1], (x,), rows=rows, num_warps=num_warps,
                 interpret=interpret, name="quantize_rows")


def silu_mul_quant(gate, up, scales=None, *, num_warps: int = 16, two_pass: bool = False,
                   chunk: int | None = None, rows: int = 1, interpret: bool = False):
    """Fused silu_mul_quant_reference: gate, up [T, I] (and its scales) -> (e4m3 [T, I],
    scale [T, 1]). num_warps: 16 ran fastest of 4, 8, 16 and 32 at 512 to 2,048 tokens
    (H100, bench/results/log/fp8.md §92-93). chunk: columns per piece of the row, a power
    of 2 (None: chunk_of(width)); on the H100 pieces of 4,096 or 8,192 were no faster.
    two_pass: the row read twice (absmax, then values) instead of held whole: the same
    result, fewer registers a program, and slower on the H100. rows: rows a program (a
    power of 2 dividing T; the column scales loaded once for them)."""
    if (why := unsupported(gate.shape[1])) is not None:
        raise ValueError(why)
    t, width = gate.shape
    args: tuple = (gate, up)
    if scales is not None:  # f32 vectors: the row scales one per program, columns chunked
        row, gate_cols, up_cols = (jnp.asarray(x, jnp.float32) for x in scales)
        args += (jnp.broadcast_to(row.reshape(-1), (t,)), gate_cols, up_cols)
    if chunk is not None and (chunk & (chunk - 1) or two_pass):
        raise ValueError(f"chunk {chunk}: a power of 2, for one pass")
    kern = functools.partial(_silu_mul_quant_kernel, chunk=chunk or chunk_of(width),
                             scaled=scales is not None, two_pass=two_pass)
    return _call(kern, t, width, args, rows=rows, num_warps=num_warps, interpret=interpret,
                 name="silu_mul_quant")
