"""The attention interface between a decoder layer and whatever stores the KV cache.

A layer hands its backend the unrotated q, k, v of the packed tokens; the backend applies
RoPE, stores k and v, and returns the attention output and the new cache of that layer.
One job a module:

- backend.py: the Protocols (Attention, AttentionBackend) and PagedAttention, a backend
  made of an append and an attend function;
- metadata.py: what a step tells attention about its batch (PagedMetadata, the
  chunked-prefill kernel's query blocks, a nano-batch's slice);
- append.py: RoPE on the keys and the write into the pages (pure JAX or one Pallas
  kernel), FP8 pages quantized on the way in;
- reference.py: the pure-JAX references (contiguous and paged cache);
- cpu_blocked.py: the CPU backend, blocked online-softmax attention (paged_attention);
- pallas.py: the GPU backend, the Pallas paged kernels (pallas_backend).

Every public name is re-exported here: `from nanojax.layers.attention import X`.
"""
from nanojax.layers.attention.append import append_kv, append_kv_pallas, write_kv_pages
from nanojax.layers.attention.backend import Attention, AttentionBackend, PagedAttention
from nanojax.layers.attention.cpu_blocked import (PER_TOKEN_GATHER_PAGES, attend_cpu,
                                                  paged_attention)
from nanojax.layers.attention.metadata import (ContiguousMetadata, PagedMetadata,
                                               prefill_metadata, slice_metadata)
from nanojax.layers.attention.pallas import (attend_pallas, choose_decode_kernel,
                                             decode_programs, decode_rows, pallas_backend,
                                             prepare_pallas)
from nanojax.layers.attention.reference import (NEG_INF, attend_reference,
                                                contiguous_attention, gather_sequence_kv,
                                                init_contiguous_cache,
                                                paged_attention_reference)

__all__ = [
    "Attention", "AttentionBackend", "ContiguousMetadata", "NEG_INF",
    "PER_TOKEN_GATHER_PAGES", "PagedAttention", "PagedMetadata", "append_kv",
    "append_kv_pallas", "attend_cpu", "attend_pallas", "attend_reference",
    "choose_decode_kernel", "contiguous_attention", "decode_programs", "decode_rows",
    "gather_sequence_kv", "init_contiguous_cache", "paged_attention",
    "paged_attention_reference", "pallas_backend", "prefill_metadata", "prepare_pallas",
    "slice_metadata", "write_kv_pages",
]
