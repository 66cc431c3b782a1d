"""The setup machine's states, one module per state, each a pure decision function over frozen Structs (and a small
apply where it has an effect); no torch, triton or flashinfer at import."""
