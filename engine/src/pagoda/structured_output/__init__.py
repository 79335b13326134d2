"""Grammar-constrained decoding (structured outputs) on xgrammar.

``params`` describes what a request asks for (no heavy imports, so ``SamplingParams`` can hold it);
``compiler`` turns it into a compiled grammar off the engine thread, cached by spec; ``grammar`` keeps one
sequence's matcher state and builds the whole step's token bitmask.
"""
