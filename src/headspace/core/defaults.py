"""The lesson's defaults, shared by ``headspace explain``, ``subspaces``, the explorer page and the notebooks.

Encoders (BERT, MiniLM) read the classic coreference example: which heads send "it" to "animal"?

Decoders (GPT-2, SmolLM2) see only the past, and what their heads do best is copy it forward: in
:data:`DECODER_SENTENCE` the second "cat" repeats "The cat" of the first clause, and SmolLM2's strongest
heads there look at "sat", the word that followed "The cat" and "The dog" before, which is the model's
next token (measured: layer 23 head 0 puts 0.43 of its weight on a "sat", layer 24 head 4 0.34 and 0.27 on
the two; greedy decoding continues with " sat"; induction-style copying, Olsson et al. 2022).
"""

from __future__ import annotations

from typing import Any

DEFAULT_SENTENCE = "The animal didn't cross the street because it was too tired"
DEFAULT_TOKEN = "it"

DECODER_SENTENCE = "The cat sat on the mat. The dog sat on the rug. The cat"
DECODER_TOKEN = "cat"
#: The explained occurrence of :data:`DECODER_TOKEN`: the second, the last token of the sentence.
DECODER_OCCURRENCE = 2

#: A paragraph long enough for the rotary planes of ``headspace subspaces`` (about 100 tokens: a plane
#: whose wavelength is shorter turns at least once across it and so reads position, a longer one content).
DECODER_PARAGRAPH = (
    "Attention lets every token look at the others. Each head projects the token into a query, a key "
    "and a value with its own matrices, scores the query against every key, and mixes the values by "
    "those scores. Some heads look at the previous token, some at the first one, some at the word that "
    "followed the last time the current word appeared, and some at the words that mean the same thing. "
    "The output projection then weighs the heads and writes their mixture back into the residual stream."
)


def is_decoder(pretrained: Any) -> bool:
    """Whether a loaded model (or a bare model) is a decoder: its config says ``arch="decoder"``."""
    model = getattr(pretrained, "model", pretrained)
    return getattr(getattr(model, "config", None), "arch", None) == "decoder"


def default_sentence(pretrained: Any) -> str:
    """The lesson's sentence for this model: :data:`DECODER_SENTENCE` for a decoder, else
    :data:`DEFAULT_SENTENCE`."""
    return DECODER_SENTENCE if is_decoder(pretrained) else DEFAULT_SENTENCE
