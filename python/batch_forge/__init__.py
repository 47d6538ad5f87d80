"""batch_forge from Python: the engine `forge` runs, in-process.

    >>> import batch_forge
    >>> m = batch_forge.Model("SmolLM2-135M-Instruct.Q4_1.gguf")
    >>> m.generate("The capital of France is", max_tokens=8, temperature=0)
    >>> for piece in m.stream("Once upon a time", max_tokens=32): print(piece, end="")
    >>> m.chat([{"role": "user", "content": "Hi!"}], max_tokens=32)
    >>> m.score("The cat sat on the mat.")            # per-token log-probabilities
    >>> m.loglikelihood("The cat sat on the", " mat")  # (sum, is_greedy), as lm-eval asks

Every call releases the GIL while it computes. Engine errors raise ForgeError with the
message `forge` prints; bad arguments raise ValueError or TypeError. The guide is
docs/python.md in the repository.
"""

from ._native import Completion, ForgeError, Model, Stream, __version__

__all__ = ["Model", "Completion", "Stream", "ForgeError", "__version__"]
