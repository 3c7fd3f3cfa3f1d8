"""Engines that span ranks: the engine <-> worker channel (a ``PageMapper`` over every TP x
PP worker, vLLM) and the agreement of allocation outcomes across ranks that must decide
alike (SGLang TP)."""
