"""transformers 5 hands a model `rope_scaling` as its `rope_parameters` dict (with the theta in
it), which nano-vllm-fork's cached get_rope can neither hash nor read: `install()` lets a plain
RoPE pass as before, with its theta, and refuses any other kind. Shared by the scripts and tests
that run nano-vllm (this folder is on their sys.path for the flash_attn stand-in)."""


def install():
    import nanovllm.models.qwen3 as q3
    get_rope = q3.get_rope
    if getattr(get_rope, "kvdiff_compat", False):
        return

    def rope_compat(head_size, rotary_dim, max_position, base, rope_scaling=None):
        if isinstance(rope_scaling, dict):
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if kind != "default":
                raise ValueError(f"nano-vllm-fork runs only default RoPE, not {kind}")
            base, rope_scaling = rope_scaling.get("rope_theta", base), None
        return get_rope(head_size, rotary_dim, max_position, base, rope_scaling)
    rope_compat.kvdiff_compat = True
    q3.get_rope = rope_compat
