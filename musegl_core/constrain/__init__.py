"""Constrained decoding: output grammars (front) and grammar processors (worker)."""
