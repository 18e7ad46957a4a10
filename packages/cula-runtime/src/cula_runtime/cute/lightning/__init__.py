"""Lightning Attention kernels written in CuTeDSL (KDA_SPEC.md §5; issue 28).

Importing this package needs neither CuTeDSL nor a GPU; the kernel modules import CuTeDSL when they are imported.

* ``decode.py``: the decode step over an in-place state pool (``decode_backend.py``: the ``cutedsl`` backend of
  ``cula.lightning.lightning_decode``).
* ``chunk_states.py``: each segment's own state and the scan over segments (initial states, pool slots, final
  states); ``chunk_output.py``: the outputs of each segment from its start state; ``prefill_backend.py``: the
  ``cutedsl`` backend of ``cula.lightning.lightning_prefill`` (the segment table, then the three launches).
"""
