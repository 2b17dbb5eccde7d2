"""The lesson's defaults, shared by ``headspace explain``, the explorer page and the notebooks.

The sentence is the classic coreference example: which heads send "it" to "animal"?
"""

DEFAULT_SENTENCE = "The animal didn't cross the street because it was too tired"
DEFAULT_TOKEN = "it"
