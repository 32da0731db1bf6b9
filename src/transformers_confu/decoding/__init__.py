"""Speculative decoding: the assistant, the loop, the draft tree, acceptance, the oracle."""
