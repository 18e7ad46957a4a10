"""Pure-PyTorch reference backend: KDA (naive fp64 oracle and chunked fp32) and Lightning Attention.

Only torch is imported here (no triton, CuTeDSL or FLA). See ``/work/shared/KDA_SPEC.md`` for the math.
"""

from __future__ import annotations

from .kda_chunked import (
    RCP_LN2,
    ChunkLayout,
    KdaChunkIntermediates,
    chunk_gate_terms,
    chunk_local_cumsum,
    kda_chunk_output,
    kda_chunk_scores,
    kda_chunk_states,
    kda_chunk_wu,
    kda_chunked,
    kda_fwd_h,
    kda_fwd_intra,
    kda_fwd_o,
    unit_lower_inverse,
)
from .kda_naive import check_kda_shapes, kda_naive
from .lightning import lightning_chunked, lightning_decode, lightning_naive
from .preprocess import (
    expand_qk_heads,
    kda_beta,
    kda_gate,
    l2norm,
    merge_sequences,
    prepare_kda_inputs,
    split_sequences,
    validate_cu_seqlens,
)

__all__ = [
    "RCP_LN2",
    "ChunkLayout",
    "KdaChunkIntermediates",
    "check_kda_shapes",
    "chunk_gate_terms",
    "chunk_local_cumsum",
    "expand_qk_heads",
    "kda_beta",
    "kda_chunk_output",
    "kda_chunk_scores",
    "kda_chunk_states",
    "kda_chunk_wu",
    "kda_chunked",
    "kda_fwd_h",
    "kda_fwd_intra",
    "kda_fwd_o",
    "kda_gate",
    "kda_naive",
    "l2norm",
    "lightning_chunked",
    "lightning_decode",
    "lightning_naive",
    "merge_sequences",
    "prepare_kda_inputs",
    "split_sequences",
    "unit_lower_inverse",
    "validate_cu_seqlens",
]
