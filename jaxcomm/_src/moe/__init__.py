"""MoE expert-parallel dispatch/combine (public API: jaxcomm/moe.py)."""
