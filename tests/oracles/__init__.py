"""Plain-Python twins of the native core, kept as test oracles: differential
tests check the native code's answers against them. None of them is part of
rdmakv."""
