"""The attention setup machine: its step table, ``build_attention_backends`` and what it returns."""
