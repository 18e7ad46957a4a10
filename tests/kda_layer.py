"""A small KDA layer written as a model writes one, over cuLA's custom ops (``torch.ops.cula``), for the tests of
``torch.compile`` on the CPU (``tests/api/test_custom_ops.py``) and on the GPU
(``tests/gpu/test_custom_ops_gpu.py``)."""

from __future__ import annotations

import torch
from torch import nn


class TinyKda(nn.Module):
    """Projections, the gate / L2 norm / beta sigmoid in kernel, ``torch.ops.cula.kda_prefill``, the output
    projection; :meth:`step` is one decode token per sequence on the state pool the layer holds (a buffer
    ``[P, HV, K, V]`` fp32), through ``torch.ops.cula.kda_decode_out``.

    ``forward(x)``: ``x`` ``[B, T, hidden]`` -> ``[B, T, hidden]``. ``step(x, slots)``: ``x`` ``[N, 1, hidden]``,
    ``slots`` int32 ``[N]`` on x's device -> ``[N, 1, hidden]``, the pool updated in place.
    """

    def __init__(self, hidden: int = 32, H: int = 2, HV: int = 4, K: int = 8, V: int = 8, P: int = 6) -> None:
        super().__init__()
        self.H, self.HV, self.K, self.V = H, HV, K, V
        self.q_proj = nn.Linear(hidden, H * K, bias=False)
        self.k_proj = nn.Linear(hidden, H * K, bias=False)
        self.v_proj = nn.Linear(hidden, HV * V, bias=False)
        self.g_proj = nn.Linear(hidden, HV * K, bias=False)
        self.b_proj = nn.Linear(hidden, HV, bias=False)
        self.o_proj = nn.Linear(HV * V, hidden, bias=False)
        self.A_log = nn.Parameter(0.1 * torch.randn(HV))
        self.dt_bias = nn.Parameter(0.1 * torch.randn(HV * K))
        self.register_buffer("pool", torch.zeros(P, HV, K, V))

    def projections_to(self, dtype: torch.dtype) -> TinyKda:
        """The projections' weights in ``dtype`` (bf16 for the GPU kernels); the gate parameters and the pool stay
        fp32."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.to(dtype)
        return self

    def _project(self, x: torch.Tensor):
        B, T, _ = x.shape
        return (self.q_proj(x).view(B, T, self.H, self.K), self.k_proj(x).view(B, T, self.H, self.K),
                self.v_proj(x).view(B, T, self.HV, self.V), self.g_proj(x).view(B, T, self.HV, self.K),
                self.b_proj(x).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v, g, beta = self._project(x)
        o, _ = torch.ops.cula.kda_prefill(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                          use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                                          A_log=self.A_log, dt_bias=self.dt_bias)
        return self.o_proj(o.flatten(-2))

    def step(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        q, k, v, g, beta = self._project(x)
        o = torch.empty_like(v)
        torch.ops.cula.kda_decode_out(q, k, v, g, beta, self.pool, slots, o, use_qk_l2norm_in_kernel=True,
                                      use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=self.A_log,
                                      dt_bias=self.dt_bias)
        return self.o_proj(o.flatten(-2))
