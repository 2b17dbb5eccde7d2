"""Content tokens: the words a relational head can send a token to (``explain``'s head choice).

A token is a **content token** when it starts a word and its text, without the tokenizer's space mark
(GPT-2's ``Ġ``, SentencePiece's ``▁``, the command line's ``␣``), is alphabetic and is not an English
function word (:data:`STOPWORDS`: articles, pronouns, auxiliaries, prepositions, conjunctions and the
pieces contractions split into, such as ``didn`` and ``t``). Punctuation, numbers, special tokens, pieces
such as ``'t`` and the later pieces of a split word (BERT's ``##ing``; SmolLM2's ``case`` after ``␣suit``)
are not content: the word is counted once, at its first piece. For a query token, its own position and
every other occurrence of the same word are not content either (:func:`content_positions`): a head that
sends "it" to another "it" relates nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

#: English function words (lower case), with the pieces that contractions tokenize into.
STOPWORDS = frozenset(
    """
    a an the this that these those it its itself he him his himself she her hers herself they them their
    theirs themselves i me my mine myself we us our ours ourselves you your yours yourself yourselves one
    who whom whose which what where when why how there here
    am is are was were be been being have has had having do does did doing done will would shall should
    can could may might must ought
    not no nor never only very too so than then also just even still yet again ever
    and or but if because as until while although though whether either neither both each every all any
    some such own same other few more most less many much
    of at by for with about against between into through during before after above below to from up down
    in out on off over under onto upon within without across along around behind beyond near since toward
    towards via per
    s t d ll m o re ve y don didn doesn hadn hasn haven isn wasn weren won wouldn shouldn couldn mustn
    needn aren ain shan mightn
    """.split()
)

#: The marks tokenizers put before a word (a space) or a word piece.
_MARKS = ("Ġ", "▁", "␣", "##")
#: The space marks: a tokenizer that writes them marks where words start.
_SPACE_MARKS = ("Ġ", "▁", "␣")


def word_of(token: str) -> str:
    """The token's text without its leading word mark (``"Ġcat"`` -> ``"cat"``, ``"##ing"`` -> ``"ing"``)."""
    for mark in _MARKS:
        if token.startswith(mark) and len(token) > len(mark):
            return token[len(mark) :]
    return token


def is_content_token(token: str) -> bool:
    """Whether ``token`` is a content token (see the module): alphabetic, not a function word."""
    word = word_of(token.strip())
    return word.isalpha() and word.lower() not in STOPWORDS


def continues_word(tokens: Sequence[str], j: int) -> bool:
    """Whether ``tokens[j]`` is a later piece of a word: BERT's ``##`` pieces; with a tokenizer that marks
    spaces (some token of ``tokens`` starts with one), a token without the mark right after a token that
    ends in a letter (``case`` after ``␣suit``)."""
    t = tokens[j]
    if t.startswith("##"):
        return True
    if j == 0 or t.startswith(_SPACE_MARKS) or not any(x.startswith(_SPACE_MARKS) for x in tokens):
        return False
    previous = tokens[j - 1]
    return bool(previous) and previous[-1].isalpha()


def content_positions(tokens: Sequence[str], index: int, special: Collection[int]) -> list[int]:
    """The positions of content tokens the token at ``index`` can be sent to: content tokens that start
    a word, are not special (``special``: positions of [CLS], BOS ...), not ``index`` itself and not
    another occurrence of the same word."""
    own = word_of(tokens[index].strip()).lower()
    return [
        j
        for j, t in enumerate(tokens)
        if j != index
        and j not in special
        and is_content_token(t)
        and not continues_word(tokens, j)
        and word_of(t.strip()).lower() != own
    ]
