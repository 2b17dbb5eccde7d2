"""``headspace`` with no command (and ``python -m headspace``): a short tour of the bundled model."""

from __future__ import annotations

SENTENCES = (
    "A man is playing a guitar.",
    "Someone is strumming a guitar.",
    "The stock market fell sharply today.",
)


def demo() -> None:
    """The main job: all-MiniLM-L6-v2 on headspace's own layers, with its heads in plain sight."""
    import torch

    from ..pretrained import PretrainedEncoder, cosine, load

    model = load("minilm")  # not installed: one line, by the command group (cli.errors.reported)
    assert isinstance(model, PretrainedEncoder)
    attn = model.model.blocks[0].attn
    print(model.config.summary())
    print(
        f"every layer's heads: W_Q {list(attn.W_Q.shape)}  W_K {list(attn.W_K.shape)}  "
        f"W_V {list(attn.W_V.shape)}  W_O {list(attn.W_O.shape)}"
    )
    emb = model.encode(list(SENTENCES))  # (3, d_model)
    print(f"sentence embeddings {list(emb.shape)} (mean over real tokens, L2-normalised):")
    for i, s in enumerate(SENTENCES):
        print(f"  [{i}] {s}")
    print(
        f"cosine([0], [1]) = {cosine(emb[0], emb[1]):.4f}    cosine([0], [2]) = {cosine(emb[0], emb[2]):.4f}"
    )

    tokens, key_padding = model.tokenize([SENTENCES[0]])
    seen: dict[int, torch.Tensor] = {}
    removers = [
        b.attn.hook_pattern.add(lambda v, hp, i=i: seen.__setitem__(i, v[0]))
        for i, b in enumerate(model.model.blocks)
    ]
    try:
        model(tokens, key_padding)
    finally:
        for remove in removers:
            remove()
    words = model.tokenizer.tokens(SENTENCES[0])
    q = words.index("guitar")
    layer = len(seen) - 1
    pattern = seen[layer][:, q]  # (n_heads, seq_k): where "guitar" looks, per head
    print(f"where 'guitar' attends in layer {layer}, per head (top key and its weight):")
    cells = [
        f"h{h}:{words[int(pattern[h].argmax())]}={float(pattern[h].max()):.2f}" for h in range(len(pattern))
    ]
    for i in range(0, len(cells), 6):
        print(("  " + "  ".join(f"{c:<18}" for c in cells[i : i + 6])).rstrip())
