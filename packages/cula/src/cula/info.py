"""``python -m cula info``: versions, the GPU, and which backend ``kda_prefill`` picks for a typical call and why (and
``kda_decode``, ``lightning_prefill`` and ``lightning_decode`` for theirs)."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch

from cula_runtime import cute
from cula_runtime.kda_args import gate_is_bounded, validate_kda_prefill
from cula_runtime.kda_decode_args import validate_kda_decode
from cula_runtime.lightning_args import validate_lightning_decode, validate_lightning_prefill

from . import dispatch

__all__ = ["collect_info", "format_info", "other_op_choices", "typical_call"]

_DISTRIBUTIONS = ("cula", "cula-runtime", "cula-sm90", "torch", "nvidia-cutlass-dsl", "apache-tvm-ffi")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def typical_call(device: torch.device, **overrides):
    """Validated arguments of a typical serving call (bf16, K=V=128, gate/L2 norm/beta sigmoid in kernel), with
    ``overrides`` of its keyword arguments."""
    B, T, H, HV, K, V = 1, 128, 4, 4, 128, 128
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)

    kwargs = dict(
        initial_state=rand(B, HV, K, V, dt=torch.float32), output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
        A_log=rand(HV, dt=torch.float32), dt_bias=rand(HV * K, dt=torch.float32),
    )
    kwargs.update(overrides)
    g = rand(B, T, HV, K, dt=torch.float32)
    if not kwargs["use_gate_in_kernel"]:  # a precomputed log-gate: <= 0, inside [-5, 0]
        g = -5.0 * torch.sigmoid(g)
    return validate_kda_prefill(rand(B, T, H, K), rand(B, T, H, K), rand(B, T, HV, V), g,
                                rand(B, T, HV, dt=torch.float32), **kwargs)


# The gate forms kda_prefill accepts, as overrides of typical_call's arguments: which kernel form serves each
# (cula_runtime.kda_args.gate_is_bounded) and which backends accept it, asked of the backends themselves.
GATE_FORMS = {
    "lower-bound gate in kernel, lower_bound=-5 (safe_gate)": {},
    "lower-bound gate in kernel, lower_bound=-12": {"safe_gate": False, "lower_bound": -12.0},
    "softplus gate in kernel (Kimi-Linear)": {"safe_gate": False, "lower_bound": None},
    "precomputed g, safe_gate=True (g in [-5, 0])": {"use_gate_in_kernel": False, "A_log": None, "dt_bias": None},
    "precomputed g, safe_gate=False (any g <= 0)": {"use_gate_in_kernel": False, "A_log": None, "dt_bias": None,
                                                    "safe_gate": False, "lower_bound": None},
}


def gate_form_support(device: torch.device) -> dict[str, str]:
    """For each of :data:`GATE_FORMS`: the kernel form that serves it and each backend's answer on ``device``."""
    out = {}
    for form, overrides in GATE_FORMS.items():
        args = typical_call(device, **overrides)
        kernel = "bounded kernels" if gate_is_bounded(args) else "unbounded-gate kernels"
        answers = ", ".join(f"{name} {'yes' if ask(args)[0].ok else 'no'}" for name, ask in dispatch._BACKENDS.items())
        out[form] = f"{kernel}; {answers}"
    return out


def other_op_choices(device: torch.device) -> dict[str, str]:
    """Which backend serves a typical call of each other op on ``device``, and why (the dispatch's summary): a
    serving decode step (``kda_decode``: 8 sequences of one token, fp32 K-first pool, gate and beta in kernel) and
    Lightning's prefill and decode (bf16, H = 4, K = V = 128, FLA's decays of layer 0 of 2)."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, dt: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)

    N, H, K = 8, 4, 128
    pool = torch.zeros(N + 1, H, K, K, device=device)
    slots = torch.arange(N, dtype=torch.int32).to(device)
    decode = validate_kda_decode(rand(N, 1, H, K), rand(N, 1, H, K), rand(N, 1, H, K), rand(N, 1, H, K),
                                 rand(N, 1, H, dt=torch.float32), state=pool, state_indices=slots,
                                 A_log=rand(H, dt=torch.float32), dt_bias=rand(H * K, dt=torch.float32),
                                 use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                 use_beta_sigmoid_in_kernel=True)
    prefill = validate_lightning_prefill(rand(1, 128, H, K), rand(1, 128, H, K), rand(1, 128, H, K), layer_idx=0,
                                         num_layers=2, output_final_state=True)
    step = validate_lightning_decode(rand(N, 1, H, K), rand(N, 1, H, K), rand(N, 1, H, K), layer_idx=0,
                                     num_layers=2, state=pool, state_indices=slots)
    return {"kda_decode": dispatch.explain_decode(decode).summary,
            "lightning_prefill": dispatch.explain_lightning_prefill(prefill).summary,
            "lightning_decode": dispatch.explain_lightning_decode(step).summary}


def collect_info() -> dict:
    """Everything ``python -m cula info`` prints, as a dict."""
    info: dict = {"versions": {d: _version(d) for d in _DISTRIBUTIONS}}
    info["cutlass_importable"] = importlib.util.find_spec("cutlass") is not None
    info["cutedsl"] = "available" if cute.is_available() else cute.unavailable_reason()
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        info["gpu"] = f"{torch.cuda.get_device_name(index)} (compute capability {major}.{minor}, sm_{major}{minor})"
        device = torch.device("cuda", index)
    else:
        info["gpu"] = "none (torch.cuda.is_available() is False)"
        device = torch.device("cpu")
    args = typical_call(device)
    choice = dispatch.explain(args)
    info["typical_call"] = f"B=1 T=128 H=HV=4 K=V=128 bf16 on {device}, gate/L2 norm/beta sigmoid in kernel"
    info["choice"] = choice.summary
    info["backends"] = {}
    for name, ask in dispatch._BACKENDS.items():
        decision, _ = ask(args)
        info["backends"][name] = ("accepts" if decision.ok else "rejects") + f": {decision.reason}"
    info["gate_forms"] = gate_form_support(device)
    info["other_ops"] = other_op_choices(device)
    return info


def format_info(info: dict) -> str:
    lines = ["cuLA info", "versions:"]
    lines += [f"  {dist:20s} {version}" for dist, version in info["versions"].items()]
    lines.append(f"  cutlass importable:  {info['cutlass_importable']}")
    lines.append(f"cutedsl kernels: {info['cutedsl']}")
    lines.append(f"gpu: {info['gpu']}")
    lines.append(f"typical kda_prefill call: {info['typical_call']}")
    lines.append(f"  picks: {info['choice']}")
    for name, answer in info["backends"].items():
        lines.append(f"  {name:10s} {answer}")
    lines.append("gate forms (the kernel form that serves each; the backends that take it on this device):")
    lines += [f"  {form}: {answer}" for form, answer in info["gate_forms"].items()]
    lines.append("other ops (a typical call of each):")
    lines += [f"  {op}: {summary}" for op, summary in info["other_ops"].items()]
    return "\n".join(lines)
