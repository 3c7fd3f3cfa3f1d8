"""Engine adapters: the kvcore side of each engine's patch series (imported only by a
patched engine, never by kvcore's core)."""
