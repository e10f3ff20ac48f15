"""Kernels for the compute worker, behind one backend interface.

`backend` defines what a model needs from its kernels: paged attention (prefill over a cached prefix plus a
new chunk, and decode, each layer's as its `LayerAttention` says: sliding window, softcap, sinks), the KV
write through a slot mapping, RMSNorm fused with the residual add, rotary embedding, SiLU-and-mul, linear
layers (whose weight may be quantized to 8 bits, `QuantizedWeight`) and a mixture of experts. `torch_ref`
implements it with plain torch on any device, the CPU included; it is also the reference the CuPy and C++
kernels are tested against.
"""
