"""The C++ CPU ops refuse what they would misread: every wrong shape, dtype, device or stride of an argument
raises a ValueError that names the argument, what it must be and what it was given, before any element is
read, as the CUDA wrappers (pagedserve/kernels/cuda_ops.py) do. Called on the compiled module itself, past the
backend's dispatch: nothing reaches the loops unchecked."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

from pagedserve.kernels.cpu_backend import CpuBackend, cpu_ops
from pagedserve.kernels.torch_ref import TorchBackend

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler here")
F64, I32 = torch.float64, torch.int32
META = torch.device("meta")  # not the CPU, and present everywhere
EPS = 1e-6
T, H, HQ, HKV, D, N = 5, 64, 6, 2, 32, 16  # tokens, hidden, query and KV heads, head dim, table rows

Args = dict[str, Any]


@pytest.fixture(scope="module")
def ops() -> ModuleType:
    built = cpu_ops()
    assert built is not None, "a compiler is here, so the C++ ops must build"
    return built


def rms_norm_args() -> Args:
    return {"x": torch.randn(T, H), "weight": torch.randn(H), "eps": EPS, "residual": torch.randn(T, H)}


def rotary_args() -> Args:
    return {
        "q": torch.randn(T, HQ, D),
        "k": torch.randn(T, HKV, D),
        "positions": torch.randint(0, N, (T,)),
        "cos_sin": torch.randn(N, 2, D),
    }


def write_kv_args() -> Args:
    return {
        "kv_layer": torch.randn(2, 8, 4, HKV, D),
        "k": torch.randn(T, HKV, D),
        "v": torch.randn(T, HKV, D),
        "slot_mapping": torch.arange(T),
    }


def silu_args() -> Args:
    return {"x": torch.randn(T, 2 * H)}


def linear_args() -> Args:
    return {
        "x": torch.randn(T, H),
        "weight": torch.randn(3 * H, H),
        "scale": None,
        "bias": torch.randn(3 * H),
    }


def decode_args() -> Args:
    return {
        "q": torch.randn(T, HQ, D),
        "kv_layer": torch.randn(2, 8, 4, HKV, D),
        "block_tables": torch.zeros(T, 3, dtype=torch.int64),
        "seq_lens": torch.ones(T, dtype=torch.int64),
        "scale": 1.0,
        "window": 0,
        "softcap": 0.0,
        "sinks": torch.zeros(HQ),
        "dot_bf16": False,
    }


def prefill_args() -> Args:
    return {
        "q": torch.randn(T, HQ, D),
        "kv_layer": torch.randn(2, 8, 4, HKV, D),
        "block_tables": torch.ones(2, 3, dtype=torch.int64),
        "seq_lens": torch.tensor([4, 6]),
        "query_start": torch.tensor([0, 2, T]),
        "scale": 1.0,
        "window": 0,
        "softcap": 0.0,
        "sinks": torch.zeros(HQ),
        "dot_bf16": False,
        "amx": False,
    }


BF16, INT8 = torch.bfloat16, torch.int8
E, J = 4, 8  # experts, and each one's MLP width


def moe_args() -> Args:
    return {
        "x": torch.randn(T, H),
        "router": torch.randn(E, H),
        "router_bias": torch.randn(E),
        "gate_up": torch.randn(E, 2 * J, H),
        "gate_up_bias": torch.randn(E, 2 * J),
        "down": torch.randn(E, H, J),
        "down_bias": torch.randn(E, H),
        "top_k": 2,
        "renormalize": True,
        "softmax_of_top": False,
        "swiglu_limit": 0.0,
        "swiglu_alpha": 1.702,
    }


# (op, the arguments changed from its good ones, what the message must say)
CASES: list[tuple[str, Args, str]] = [
    ("rms_norm", {"residual": torch.randn(T, H - 1)}, r"residual must be \[5, 64\] like x, not \[5, 63\]"),
    ("rms_norm", {"residual": torch.randn(T + 1, H)}, r"residual must be \[5, 64\] like x, not \[6, 64\]"),
    ("rms_norm", {"residual": torch.randn(T * H)}, r"residual must be \[5, 64\] like x, not \[320\]"),
    ("rms_norm", {"residual": torch.randn(T, H, dtype=F64)}, r"residual must be float32, not float64"),
    ("rms_norm", {"residual": torch.empty(T, H, device=META)}, r"residual must be on the CPU, not meta"),
    ("rms_norm", {"weight": torch.randn(H - 1)}, r"weight must be \[64\], not \[63\]"),
    ("rms_norm", {"weight": torch.randn(1, H)}, r"weight must be \[64\], not \[1, 64\]"),
    ("rms_norm", {"weight": torch.randn(H, dtype=F64)}, r"weight must be float32, not float64"),
    ("rms_norm", {"weight": torch.empty(H, device=META)}, r"weight must be on the CPU, not meta"),
    (
        "rms_norm",
        {"x": torch.randn(H), "residual": None},
        r"x must be \[T, H\] or \[T, heads, D\], not \[64\]",
    ),
    ("rms_norm", {"x": torch.randn(T, H, dtype=F64)}, r"x must be float32 or bfloat16, not float64"),
    ("rms_norm", {"weight": torch.randn(H, dtype=BF16)}, r"weight must be float32, not bfloat16"),
    ("rms_norm", {"x": torch.randn(T, H, dtype=BF16)}, r"weight must be bfloat16, not float32"),
    (
        "rms_norm",
        {"x": torch.randn(H, T).t()},
        r"x must have a contiguous last dimension, not strides \[1, 5\]",
    ),
    ("rotary", {"cos_sin": torch.randn(N, 1, D)}, r"cos_sin must be \[N, 2, 32\], not \[16, 1, 32\]"),
    ("rotary", {"cos_sin": torch.randn(N, 2, D // 2)}, r"cos_sin must be \[N, 2, 32\], not \[16, 2, 16\]"),
    ("rotary", {"cos_sin": torch.randn(N, 2 * D)}, r"cos_sin must be \[N, 2, 32\], not \[16, 64\]"),
    ("rotary", {"cos_sin": torch.randn(N, 2, D, dtype=F64)}, r"cos_sin must be float32, not float64"),
    ("rotary", {"cos_sin": torch.empty(N, 2, D, device=META)}, r"cos_sin must be on the CPU, not meta"),
    ("rotary", {"positions": torch.zeros(T, dtype=I32)}, r"positions must be int64, not int32"),
    ("rotary", {"positions": torch.zeros(T + 1, dtype=torch.int64)}, r"positions must be \[5\], not \[6\]"),
    ("rotary", {"positions": torch.zeros(T, 1, dtype=torch.int64)}, r"positions must be \[5\], not \[5, 1\]"),
    ("rotary", {"k": torch.randn(T, HKV, D // 2)}, r"k must be \[5, heads, 32\], not \[5, 2, 16\]"),
    ("rotary", {"k": torch.randn(T - 1, HKV, D)}, r"k must be \[5, heads, 32\], not \[4, 2, 32\]"),
    ("rotary", {"k": torch.randn(T, HKV, D, dtype=F64)}, r"k must be float32, not float64"),
    ("rotary", {"cos_sin": torch.randn(N, 2, D, dtype=BF16)}, r"cos_sin must be float32, not bfloat16"),
    ("rotary", {"q": torch.randn(T, HQ * D)}, r"q must be \[T, heads, D\], not \[5, 192\]"),
    (
        "rotary",
        {
            "q": torch.randn(T, HQ, D + 1),
            "k": torch.randn(T, HKV, D + 1),
            "cos_sin": torch.randn(N, 2, D + 1),
        },
        r"q's head dim must be even, not 33",
    ),
    ("rotary", {"q": torch.randn(T, D, HQ).transpose(1, 2)}, r"q must have a contiguous last dimension"),
    (
        "write_kv",
        {"kv_layer": torch.randn(3, 8, 4, HKV, D)},
        r"kv_layer must be \[2, P, B, Hkv, D\], not \[3, 8, 4, 2, 32\]",
    ),
    (
        "write_kv",
        {"kv_layer": torch.randn(2, 8, 4, HKV, D, dtype=F64)},
        r"kv_layer must be float32 or bfloat16, not float64",
    ),
    (
        "write_kv",
        {"kv_layer": torch.randn(2, 8, HKV, D, 4).transpose(3, 4).transpose(2, 3)},
        r"kv_layer must be contiguous",
    ),
    ("write_kv", {"k": torch.randn(T, HKV + 1, D)}, r"k must be \[T, 2, 32\], not \[5, 3, 32\]"),
    ("write_kv", {"k": torch.randn(T, HKV * D)}, r"k must be \[T, 2, 32\], not \[5, 64\]"),
    ("write_kv", {"k": torch.randn(T, HKV, D, dtype=F64)}, r"k must be float32 or bfloat16, not float64"),
    ("write_kv", {"k": torch.randn(T, D, HKV).transpose(1, 2)}, r"k must have a contiguous last dimension"),
    ("write_kv", {"v": torch.randn(T - 1, HKV, D)}, r"v must be \[5, 2, 32\], not \[4, 2, 32\]"),
    ("write_kv", {"v": torch.randn(T, HKV, D, dtype=BF16)}, r"v must be float32, not bfloat16"),
    ("write_kv", {"v": torch.empty(T, HKV, D, device=META)}, r"v must be on the CPU, not meta"),
    ("write_kv", {"slot_mapping": torch.arange(T, dtype=I32)}, r"slot_mapping must be int64, not int32"),
    ("write_kv", {"slot_mapping": torch.arange(T + 1)}, r"slot_mapping must be \[5\], not \[6\]"),
    ("silu_and_mul", {"x": torch.randn(T, 2, H)}, r"x must be \[T, 2 I\], not \[5, 2, 64\]"),
    ("silu_and_mul", {"x": torch.randn(T, 2 * H + 1)}, r"x must be \[T, 2 I\], not \[5, 129\]"),
    ("silu_and_mul", {"x": torch.randn(T, 2 * H, dtype=F64)}, r"x must be float32 or bfloat16, not float64"),
    ("silu_and_mul", {"x": torch.empty(T, 2 * H, device=META)}, r"x must be on the CPU, not meta"),
    ("skinny_linear", {"bias": torch.randn(3 * H + 1)}, r"bias must be \[192\], not \[193\]"),
    ("skinny_linear", {"bias": torch.randn(1)}, r"bias must be \[192\], not \[1\]"),
    ("skinny_linear", {"bias": torch.randn(T, 3 * H)}, r"bias must be \[192\], not \[5, 192\]"),
    ("skinny_linear", {"bias": torch.randn(3 * H, dtype=F64)}, r"bias must be float32, not float64"),
    ("skinny_linear", {"bias": torch.empty(3 * H, device=META)}, r"bias must be on the CPU, not meta"),
    ("skinny_linear", {"weight": torch.randn(3 * H, H - 1)}, r"weight must be \[N, 64\], not \[192, 63\]"),
    ("skinny_linear", {"weight": torch.randn(3 * H * H)}, r"weight must be \[N, 64\], not \[12288\]"),
    ("skinny_linear", {"weight": torch.randn(3 * H, H, dtype=F64)}, r"weight must be float32, not float64"),
    ("skinny_linear", {"x": torch.randn(T, H, 1)}, r"x must be \[M, K\], not \[5, 64, 1\]"),
    ("skinny_linear", {"x": torch.empty(T, H, device=META)}, r"x must be on the CPU, not meta"),
    ("skinny_linear", {"x": torch.randn(T, H, dtype=F64)}, r"x must be float32 or bfloat16, not float64"),
    ("skinny_linear", {"weight": torch.randn(3 * H, H, dtype=BF16)}, r"weight must be float32, not bfloat16"),
    (
        "skinny_linear",
        {"weight": torch.ones(3 * H, H, dtype=INT8)},
        r"an int8 or float8 weight needs a scale",
    ),
    ("skinny_linear", {"scale": torch.ones(3 * H)}, r"a scale goes with an int8 or float8 weight only"),
    (
        "skinny_linear",
        {"weight": torch.ones(3 * H, H, dtype=INT8), "scale": torch.ones(3 * H + 1)},
        r"scale must be \[192\], not \[193\]",
    ),
    (
        "skinny_linear",
        {"weight": torch.ones(3 * H, H, dtype=INT8), "scale": torch.ones(3 * H, dtype=BF16)},
        r"scale must be float32, not bfloat16",
    ),
    (
        "skinny_linear",
        {"weight": torch.ones(3 * H, H - 1, dtype=INT8), "scale": torch.ones(3 * H)},
        r"weight must be \[N, 64\], not \[192, 63\]",
    ),
    ("paged_decode", {"q": torch.randn(T, HQ * D)}, r"q must be \[S, Hq, D\], not \[5, 192\]"),
    ("paged_decode", {"q": torch.randn(T, D, HQ).transpose(1, 2)}, r"q must be contiguous"),
    (
        "paged_decode",
        {"kv_layer": torch.randn(3, 8, 4, HKV, D)},
        r"kv_layer must be \[2, P, B, Hkv, 32\], not \[3, 8, 4, 2, 32\]",
    ),
    (
        "paged_decode",
        {"kv_layer": torch.randn(2, 8, 4, HKV, D + 2)},
        r"kv_layer must be \[2, P, B, Hkv, 32\], not \[2, 8, 4, 2, 34\]",
    ),
    ("paged_decode", {"kv_layer": torch.randn(2, 8, 4, 4, D)}, r"6 query heads over 4 KV heads"),
    ("paged_decode", {"kv_layer": torch.randn(2, 8, 4, 0, D)}, r"6 query heads over 0 KV heads"),
    (
        "paged_decode",
        {"kv_layer": torch.randn(2, 8, 4, HKV, D, dtype=F64)},
        r"kv_layer must be float32 or bfloat16, not float64",
    ),
    (
        "paged_decode",
        {"kv_layer": torch.empty(2, 8, 4, HKV, D, device=META)},
        r"kv_layer must be on the CPU, not meta",
    ),
    (
        "paged_decode",
        {"block_tables": torch.zeros(T + 1, 3, dtype=torch.int64)},
        r"block_tables must be \[5, W\], not \[6, 3\]",
    ),
    (
        "paged_decode",
        {"block_tables": torch.zeros(T, 3, dtype=I32)},
        r"block_tables must be int64, not int32",
    ),
    (
        "paged_decode",
        {"block_tables": torch.zeros(3, T, dtype=torch.int64).t()},
        r"block_tables must be contiguous",
    ),
    (
        "paged_decode",
        {"seq_lens": torch.ones(T - 1, dtype=torch.int64)},
        r"seq_lens must be \[5\], not \[4\]",
    ),
    ("paged_decode", {"seq_lens": torch.ones(T, dtype=I32)}, r"seq_lens must be int64, not int32"),
    ("paged_decode", {"sinks": torch.zeros(HQ + 1)}, r"sinks must be \[6\], not \[7\]"),
    ("paged_decode", {"sinks": torch.zeros(HQ, dtype=F64)}, r"sinks must be float32, not float64"),
    ("paged_prefill", {"q": torch.randn(T, HQ * D)}, r"q must be \[N, Hq, D\], not \[5, 192\]"),
    ("paged_prefill", {"q": torch.randn(T, HQ, D, dtype=F64)}, r"q must be float32 or bfloat16, not float64"),
    ("paged_prefill", {"q": torch.randn(T, D, HQ).transpose(1, 2)}, r"q must be contiguous"),
    (
        "paged_prefill",
        {"kv_layer": torch.randn(2, 8, 4, HKV, D + 2)},
        r"kv_layer must be \[2, P, B, Hkv, 32\], not \[2, 8, 4, 2, 34\]",
    ),
    (
        "paged_prefill",
        {"kv_layer": torch.randn(2, 8, 4, HKV, D, dtype=torch.float16)},
        r"kv_layer must be float32 or bfloat16, not float16",
    ),
    ("paged_prefill", {"kv_layer": torch.randn(2, 8, 4, 4, D)}, r"6 query heads over 4 KV heads"),
    (
        "paged_prefill",
        {"block_tables": torch.ones(2, 3, dtype=I32)},
        r"block_tables must be int64, not int32",
    ),
    ("paged_prefill", {"seq_lens": torch.tensor([4, 6, 1])}, r"seq_lens must be \[2\], not \[3\]"),
    ("paged_prefill", {"query_start": torch.tensor([0, T])}, r"query_start must be \[3\], not \[2\]"),
    (
        "paged_prefill",
        {"query_start": torch.tensor([0, 2, T], dtype=I32)},
        r"query_start must be int64, not int32",
    ),
    ("paged_prefill", {"sinks": torch.zeros(HQ - 1)}, r"sinks must be \[6\], not \[5\]"),
    ("moe", {"x": torch.randn(T, H, 1)}, r"x must be \[T, H\], not \[5, 64, 1\]"),
    ("moe", {"router": torch.randn(E, H + 1)}, r"router must be \[E, H\], not \[4, 65\]"),
    ("moe", {"gate_up": torch.randn(E + 1, 2 * J, H)}, r"gate_up must be \[E, 2 I, H\], not \[5, 16, 64\]"),
    ("moe", {"gate_up": torch.randn(E, 2 * J + 1, H)}, r"gate_up must have an even number of rows, not 17"),
    ("moe", {"down": torch.randn(E, H, J + 1)}, r"down must be \[E, H, I\], not \[4, 64, 9\]"),
    ("moe", {"down_bias": torch.randn(E)}, r"down_bias must be \[E, H\], not \[4\]"),
    ("moe", {"gate_up": torch.randn(E, 2 * J, H, dtype=F64)}, r"gate_up must be float32, not float64"),
    ("moe", {"x": torch.randn(T, H, dtype=F64)}, r"x must be float32 or bfloat16, not float64"),
    ("moe", {"router": torch.randn(E, H, dtype=BF16)}, r"router must be float32, not bfloat16"),
    ("moe", {"top_k": E + 1}, r"top_k must be 1..4, not 5"),
    ("moe", {"top_k": 0}, r"top_k must be 1..4, not 0"),
]


GOOD: dict[str, Callable[[], Args]] = {
    "rms_norm": rms_norm_args,
    "rotary": rotary_args,
    "write_kv": write_kv_args,
    "silu_and_mul": silu_args,
    "skinny_linear": linear_args,
    "paged_decode": decode_args,
    "paged_prefill": prefill_args,
    "moe": moe_args,
}


@pytest.mark.parametrize(
    ("op", "changes", "message"),
    CASES,
    ids=[f"{op}-{'-'.join(ch)}-{i}" for i, (op, ch, _) in enumerate(CASES)],
)
def test_a_wrong_argument_is_refused_by_name(ops: ModuleType, op: str, changes: Args, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        getattr(ops, op)(*(GOOD[op]() | changes).values())


@pytest.mark.parametrize("op", GOOD)
def test_the_good_arguments_pass(ops: ModuleType, op: str) -> None:
    """Each case above changes one argument of these, which the ops take as they are."""
    getattr(ops, op)(*GOOD[op]().values())


def test_strided_inputs_the_ops_copy_still_match_the_reference(ops: ModuleType) -> None:
    """The checks refuse no layout the ops handle: a strided residual, weight, bias and positions."""
    backend, reference = CpuBackend(ops), TorchBackend()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, generator=gen)
    residual = torch.randn(H, T, generator=gen).t()
    weight = torch.randn(2 * H, generator=gen)[::2]
    torch.testing.assert_close(
        backend.rms_norm(x, weight, EPS, residual), reference.rms_norm(x, weight, EPS, residual)
    )
    w, bias = torch.randn(3 * H, H, generator=gen), torch.randn(6 * H, generator=gen)[::2]
    torch.testing.assert_close(backend.linear(x, w, bias), reference.linear(x, w, bias), rtol=1e-4, atol=1e-4)
    args = rotary_args()
    args["positions"] = torch.randint(0, N, (2 * T,), generator=gen)[::2]
    expected = reference.rotary(args["q"].clone(), args["k"].clone(), args["positions"], args["cos_sin"])
    torch.testing.assert_close(backend.rotary(**args), expected, rtol=1e-5, atol=1e-5)


def test_a_position_past_the_table_is_refused_before_q_or_k_turns(ops: ModuleType) -> None:
    args = rotary_args()
    args["positions"][-1] = N
    q, k = args["q"].clone(), args["k"].clone()

    with pytest.raises(RuntimeError, match="position 16 is past the rotary table"):
        ops.rotary(*args.values())

    assert torch.equal(args["q"], q) and torch.equal(args["k"], k), "a refused call rotated rows"


def test_a_slot_past_the_pool_is_refused_before_any_row_is_written(ops: ModuleType) -> None:
    args = write_kv_args()
    pool = args["kv_layer"].clone()
    args["slot_mapping"][-1] = 8 * 4  # the first slot past 8 pages of 4

    with pytest.raises(IndexError, match="slot 32 is past the pool's 32 slots"):
        ops.write_kv(*args.values())

    assert torch.equal(args["kv_layer"], pool), "a refused call wrote rows"
