"""What the decode-attention kernel tests share: the error against the f32 reference."""
import numpy as np

from pallas_kernels.decode_attention import decode_attention_reference


def rel_error(out, q, k, v, pt, lens) -> float:
    """||out - ref|| / ||ref||, the reference in f32; fails on NaN or inf in out."""
    ref = decode_attention_reference(*(x.astype(np.float32) for x in (q, k, v)), pt, lens)
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(o).all(), "NaN or inf in the kernel output"
    return np.linalg.norm(o - r) / np.linalg.norm(r)
