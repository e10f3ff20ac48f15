"""Phi-3 (and Phi-3.5, Phi-4-mini's layout): Llama's decoder, with Q, K and V and the gate and up
projections fused in the checkpoint (`weights` loads them as they are) and Long RoPE for the long-context
variants (`decoder.rotary_table`)."""

from __future__ import annotations

from services.worker.models.decoder import CausalLM


class Phi3(CausalLM):
    model_types = ("phi3",)
